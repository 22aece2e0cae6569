"""wprep: the Python client of wprepd, which converts MXFP4 weights into GPU matmul layouts.

    import wprep
    c = wprep.Client("unix:///tmp/wprepd.sock")
    r = c.convert(wprep.Spec("hopper_value", mx_axis=-2), [2880, 2880], checkpoint_bytes)
    r.numpy(), r.identity.layout        # the Hopper storage, "HopperMXValueLayout(...)"

    # In a vLLM or SGLang loader, in place of _swizzle_mxfp4 (CUDA tensors, one round trip):
    w, flex, s = wprep.swizzle_mxfp4(values, scales, num_warps).as_triton()

    # bf16/fp16/fp32 weights to MXFP4 values and scales (numpy inline, CUDA tensors in place):
    values, scales = wprep.quantize_mxfp4(w, layout="blackwell_value")

    # Resident weight sets: load and prepare once in the daemon, attach from any engine:
    c.load_weights("gptoss", "gpt-oss-20b", rules="*_blocks=hopper_value:packing_axis=-2")
    with c.attach_weights("gptoss") as w: w["lm_head.weight"]   # zero-copy numpy views

numpy is required; torch is imported only when torch tensors are passed (CUDA IPC), and
triton_kernels only to build its Tensor objects. See docs/GUIDE.md, "From Python".
"""

from ._aio import AsyncClient
from ._client import DEFAULT_TARGET, Client, default_target
from ._errors import VmmSharingError, WprepError
from ._mxfp4 import (
    SwizzledMXFP4,
    default_client,
    empty_swizzled_mxfp4,
    mxfp4_specs,
    set_default_client,
    swizzle_mxfp4,
    swizzle_mxfp4_batch,
    wait_async,
)
from ._quantize import QuantizedMXFP4, quantize_mxfp4
from ._spec import Direction, Layout, LayoutIdentity, Spec
from ._torch import ExpandableSegmentsError, StreamMemOpsError
from ._types import BatchResult, Device, Devices, Item, Plan, Result
from . import weights
from .weights import AttachedWeights

__version__ = "0.1.0"

__all__ = [
    "AsyncClient",
    "AttachedWeights",
    "BatchResult",
    "Client",
    "DEFAULT_TARGET",
    "Device",
    "Devices",
    "Direction",
    "ExpandableSegmentsError",
    "Item",
    "Layout",
    "LayoutIdentity",
    "Plan",
    "QuantizedMXFP4",
    "Result",
    "Spec",
    "StreamMemOpsError",
    "VmmSharingError",
    "SwizzledMXFP4",
    "WprepError",
    "default_client",
    "default_target",
    "empty_swizzled_mxfp4",
    "mxfp4_specs",
    "quantize_mxfp4",
    "set_default_client",
    "swizzle_mxfp4",
    "swizzle_mxfp4_batch",
    "wait_async",
    "weights",
]
