#!/usr/bin/env sh
# Unpack torch-npu's wheel (headers only needed) into ~/.cache/paged so
# csrc_ascend builds on machines without CANN, without installing torch-npu
# (installed without CANN, it breaks `import torch` through device autoload).
# Safe when several checkouts run it at once: the wheel is unpacked into a
# private folder beside the destination and renamed into place in one step,
# so a reader sees either no folder or a whole one.
set -eu
version=2.13.0
cache="${HOME}/.cache/paged"
dest="${cache}/torch-npu-${version}"
[ -f "${dest}/torch_npu/include/acl/acl_rt.h" ] && { echo "${dest}"; exit 0; }
pip="${PIP:-python3 -m pip}"
mkdir -p "${cache}"
tmp=$(mktemp -d "${cache}/.torch-npu-${version}.XXXXXX")
trap 'rm -rf "${tmp}"' EXIT
${pip} download -q --no-deps "torch-npu==${version}" -d "${tmp}/wheel"
python3 -m zipfile -e "${tmp}"/wheel/torch_npu-*.whl "${tmp}/tree"
# rename(2) of a directory onto a missing name is atomic; if another run won
# the race, its identical tree stays and ours is removed by the trap
mv -T "${tmp}/tree" "${dest}" 2>/dev/null || [ -f "${dest}/torch_npu/include/acl/acl_rt.h" ]
echo "${dest}"
