#!/usr/bin/env bash
# For a GPU host without a package index that has torch, prometheus-client, httpx, h11, anyio, click
# and requests but not the server's web stack: download the stack's wheels for CPython 3.12 into
# .whl/ (ignored by git), copy that folder to the host and install them there before starting the
# server. fastapi imports opentelemetry-api; soundfile needs cffi (and transformers imports soundfile
# when it is present, so a soundfile without cffi breaks HF too).
#   bash mstar/bench/tools/make-server-wheels.sh .whl --check       # here: download, check the set is closed
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
set -euo pipefail
dest=${1:-.whl}
mkdir -p "$dest"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$dest" fastapi starlette pydantic pydantic-core uvicorn typing-inspection annotated-doc annotated-types \
  python-multipart openai distro jiter sniffio soundfile cffi pycparser opentelemetry-api httpx2 httptools
# check the set is closed: import the stack from these wheels alone in an empty venv (--check)
if [ "${2:-}" = "--check" ]; then
  v=$(mktemp -d); python3 -m venv --without-pip "$v/venv"
  # what the host already has (torch's, transformers' and the list above), from the index
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$v/host" anyio idna h11 click httpx httpcore \
    certifi typing-extensions requests charset-normalizer urllib3 tqdm prometheus-client numpy
  python3 -m pip install -q --no-index --no-deps --target "$v/site" "$dest"/*.whl "$v/host"/*.whl
  PYTHONPATH="$v/site" "$v/venv/bin/python" -c "import fastapi, uvicorn, multipart, openai, soundfile; print('wheels: imports ok')"
  rm -rf "$v"
fi
du -sh "$dest"; ls "$dest"
