#!/usr/bin/env bash
# Builds .gpu-bundle/ (git-ignored) for tests/gpu/run.sh: ../shared/gpu/bundle.sh's packages, plus
# what it leaves out that the GPU check needs (seen missing on the H200 machine: grpc_reflection,
# which `from ray import serve` imports; httpx2, which the openai SDK imports), plus the traces
# (the load test reads them; ../shared does not travel with a device call). Run from the repo root:
#   bash tests/gpu/bundle.sh     # then carry .gpu-bundle with the device call
set -euo pipefail
cd "$(dirname "$0")/../.."
bash ../shared/gpu/bundle.sh .gpu-bundle
plat=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform any
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64)
pin() { local v=""; [ -x .venv/bin/pip ] && v=$(.venv/bin/pip show "$1" 2>/dev/null | awk '/^Version/{print $2}'); echo "$1${v:+==$v}"; }
# grpcio-reflection: an older release, whose generated protobuf code runs on any newer protobuf
# runtime there (the machine has its own grpcio and protobuf)
python3 -m pip download -q "${plat[@]}" -d .gpu-bundle grpcio-reflection==1.62.3
for p in httpx2 httpcore2 truststore; do
  python3 -m pip download -q "${plat[@]}" -d .gpu-bundle "$(pin $p)"
done
mkdir -p .gpu-bundle/data && cp -r ../shared/data/traces .gpu-bundle/data/
du -sh .gpu-bundle
