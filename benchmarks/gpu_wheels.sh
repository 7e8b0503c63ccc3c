#!/bin/sh
# Wheels that benchmarks/gpu_check.py needs beyond the GPU machine's image (Python 3.12, torch 2.11,
# transformers 5.17, grpcio, protobuf, numpy, safetensors, PyYAML; no downloads there): the pydantic
# stack of the learner's config. A few MB; carry the folder with the code (`run` tool: carry
# gpu_wheels), then on the GPU machine:
#   pip install --no-index --find-links gpu_wheels pydantic && PYTHONPATH=. python benchmarks/gpu_check.py
set -eu
out="${1:-gpu_wheels}"
python3 -m pip download --quiet --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d "$out" pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions
ls -l "$out"
