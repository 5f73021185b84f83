# syntax=docker/dockerfile:1
# registry-janitor: one static-ish binary (links glibc), no runtime files.
#
#   docker build -t registry-janitor:0.1.0 .
#   docker run --rm -e JANITOR_REDIS_URL=redis://host:6379 registry-janitor:0.1.0 worker
#
# The builder and the runtime are both Debian 12 (bookworm), so the glibc the binary was
# linked against is the one it runs on. For reproducible builds pin both images by digest
# (FROM image:tag@sha256:...).

FROM rust:1.95-bookworm AS builder
WORKDIR /build
COPY Cargo.toml Cargo.lock ./
# The workspace's other members (the test harness and the lab): cargo reads their
# manifests to resolve the workspace; only the service crate is built.
COPY crates ./crates
COPY src ./src
# The connection-server scripts, compiled into the binary.
COPY protocol ./protocol
COPY schemas ./schemas
# BuildKit cache mounts keep the crate registry and target/ between builds; the binary is
# copied out of the cached target/ because cache mounts are not part of the image.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/build/target \
    cargo build --release --locked -p registry-janitor \
    && install -D -m 0755 target/release/registry-janitor /out/registry-janitor

# distroless "cc": glibc, libgcc, CA certificates, no shell, no package manager; the
# `nonroot` tag runs as uid/gid 65532.
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=builder /out/registry-janitor /usr/local/bin/registry-janitor
# Numeric, so that Kubernetes' runAsNonRoot can verify it.
USER 65532:65532
# /metrics, /healthz, /readyz (setting metrics_addr, default 0.0.0.0:9464).
EXPOSE 9464
ENTRYPOINT ["/usr/local/bin/registry-janitor"]
CMD ["worker"]
