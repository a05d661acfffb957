#!/usr/bin/env sh
# Unpack torch-npu's wheel (headers only needed) into ~/.cache/paged so
# csrc_ascend builds on machines without CANN, without installing torch-npu
# (installed without CANN, it breaks `import torch` through device autoload).
set -eu
version=2.13.0
dest="${HOME}/.cache/paged/torch-npu-${version}"
[ -f "${dest}/torch_npu/include/acl/acl_rt.h" ] && { echo "${dest}"; exit 0; }
pip="${PIP:-python3 -m pip}"
tmp=$(mktemp -d)
trap 'rm -rf "${tmp}"' EXIT
${pip} download -q --no-deps "torch-npu==${version}" -d "${tmp}"
mkdir -p "${dest}"
python3 -m zipfile -e "${tmp}"/torch_npu-*.whl "${dest}"
echo "${dest}"
