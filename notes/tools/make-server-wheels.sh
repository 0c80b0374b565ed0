#!/usr/bin/env bash
# The GPU host has torch, prometheus-client, httpx, h11, anyio, click, requests but not the
# server's web stack. Download its wheels for CPython 3.12 into .whl/ (ignored by git),
# carry ".whl" and install them there before starting the server:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
set -euo pipefail
dest=${1:-.whl}
mkdir -p "$dest"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$dest" fastapi starlette pydantic pydantic-core uvicorn typing-inspection annotated-doc annotated-types \
  python-multipart openai distro jiter sniffio soundfile
du -sh "$dest"; ls "$dest"
