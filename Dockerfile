# specmesh: one image for router, target and draft (the command picks the role).
# CPU by default; for GPUs build with a CUDA torch, e.g.
#   docker build --build-arg TORCH="torch==2.9.1" --build-arg EXTRAS="[gpu]" -t specmesh .
FROM python:3.11-slim
ARG TORCH="torch==2.13.0"
ARG EXTRAS=""
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY specmesh specmesh
COPY cli cli
COPY protocol protocol
COPY runtime runtime
COPY router router
COPY rpc rpc
COPY target_service target_service
COPY draft_service draft_service
COPY kernels kernels
COPY demo demo
COPY bench bench
COPY protos protos
COPY models models
RUN pip install "${TORCH}" && pip install ".${EXTRAS}"
# Run as an unprivileged user (uid 10001, as the k8s manifests' runAsUser): /app stays root-owned
# and read-only to it; caches (Triton, $SPECMESH_CACHE) go to its home.
RUN useradd --create-home --uid 10001 specmesh
USER 10001
EXPOSE 50051 50052 50053
ENTRYPOINT ["specmesh"]
CMD ["up", "--host", "0.0.0.0", "--port", "50051"]
