# syntax=docker/dockerfile:1
# wprepd image. The build stage runs the scripts CI runs (scripts/bootstrap.sh, then
# scripts/stage_runtime.sh, which is `make build` plus the runtime files); the final stage
# is a CUDA runtime image with those files and nothing else, run as a non-root user.
#
#   docker build -t wprepd:0.1.0 .                       # sm_90 + sm_100 + PTX
#   docker build --build-arg CUDA_ARCHS=90-real -t wprepd:0.1.0-sm90 .
#   docker run --rm --gpus all --pid=host -v wprep-run:/run/wprep -p 9464:9464 wprepd:0.1.0
#
# Flags: `docker run --rm wprepd:0.1.0 --help`. Arguments after the image replace CMD.
ARG CUDA_VERSION=13.0.1
ARG UBUNTU_VERSION=24.04

FROM nvidia/cuda:${CUDA_VERSION}-devel-ubuntu${UBUNTU_VERSION} AS build
# Empty: the project's default architectures. "90-real" builds Hopper machine code only.
ARG CUDA_ARCHS=
WORKDIR /src
# The package list alone first, so the toolchain layer survives source changes.
COPY scripts/bootstrap.sh scripts/bootstrap.sh
RUN bash scripts/bootstrap.sh
COPY . .
RUN bash scripts/stage_runtime.sh /stage

FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu${UBUNTU_VERSION}
LABEL org.opencontainers.image.title="wprepd" \
      org.opencontainers.image.description="MXFP4 weight layout conversion daemon (gRPC, CUDA IPC)"
COPY --from=build /stage/opt/wprep /opt/wprep
# The socket folder, owned by the daemon's user; mount a volume here to share the socket.
COPY --from=build --chown=65532:65532 /stage/run/wprep /run/wprep
# The base image's LD_LIBRARY_PATH names the driver libraries the NVIDIA runtime mounts.
ENV PATH=/opt/wprep/bin:${PATH} \
    LD_LIBRARY_PATH=/opt/wprep/lib:${LD_LIBRARY_PATH} \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    CUDA_CACHE_PATH=/tmp/cuda-cache
USER 65532:65532
VOLUME ["/run/wprep"]
# 8081: grpc.health.v1 only (--health-listen). 9464: Prometheus /metrics.
# The conversion API is on the Unix socket in /run/wprep only.
EXPOSE 8081 9464
# SIGTERM drains in-flight work for up to --drain-timeout (30 s): `docker stop -t 45`.
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=5s --start-period=300s --retries=3 \
  CMD ["wprep", "health", "--target", "unix:///run/wprep/wprepd.sock", "--timeout", "3s"]
ENTRYPOINT ["wprepd"]
CMD ["--listen=unix:///run/wprep/wprepd.sock", "--health-listen=0.0.0.0:8081", "--metrics-address=0.0.0.0:9464"]
