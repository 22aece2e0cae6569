"""CUDA memory and ordering of the client: torch tensors as CUDA IPC buffers (ipc) and the
fences a batch is ordered on the GPU with (fences). Imported only when a torch tensor is
handed in; the rest of the package needs no torch."""
