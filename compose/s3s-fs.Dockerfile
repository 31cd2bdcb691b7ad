# An S3-compatible server for local clusters and tests: `s3s-fs` (crates.io), objects as
# files under /data. Build context: compose/.
#   from source:            docker build -f s3s-fs.Dockerfile -t cumulus-s3s-fs .
#   from a host-built one:  --build-arg S3S_FS_BIN=.s3s/s3s-fs (path inside compose/)
#                           plus local BUILDER_IMAGE and BASE_IMAGE (see Dockerfile)
ARG BUILDER_IMAGE=rust:1.95-bookworm
ARG BASE_IMAGE=debian:bookworm-slim

FROM ${BUILDER_IMAGE} AS build
LABEL cumulus.stage=build
ARG S3S_FS_BIN=
COPY . /ctx
RUN set -eu; \
    if [ -n "$S3S_FS_BIN" ]; then \
      install -m 0755 "/ctx/$S3S_FS_BIN" /s3s-fs; \
    else \
      cargo install s3s-fs@0.14.1 --locked --features binary --root /usr/local; \
      install -m 0755 /usr/local/bin/s3s-fs /s3s-fs; \
    fi

FROM ${BASE_IMAGE}
RUN set -eu; \
    if ! command -v curl >/dev/null || ! command -v tini >/dev/null; then \
      apt-get update; \
      DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends curl tini; \
      rm -rf /var/lib/apt/lists/*; \
    fi
COPY --from=build /s3s-fs /usr/local/bin/s3s-fs
RUN mkdir -p /data
VOLUME ["/data"]
EXPOSE 9000
ENTRYPOINT ["tini", "--", "s3s-fs"]
