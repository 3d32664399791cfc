#!/usr/bin/env bash
# Issue 32, item 2: SGLang 0.5.17 for the GPU machines (torch 2.11.0+cu130, Python 3.12, no network), packed into
# groups of at most 58 MiB so that each fits one `run` transfer (64 MiB), as ../shared/gpu/fetch_wheels.sh packs
# vLLM's. Here, from the project root:
#   bash benchmarks/gpu/sglang_pack.sh          -> .gpu-wheels/s1 ... sN (~1.3 GB; the last group holds the installer)
# There, one `run` per group (carry [".gpu-wheels/sN"]): mkdir -p /tmp/sstage && cp -r .gpu-wheels/sN/. /tmp/sstage/
# then: bash /tmp/sstage/sglang_install.sh   -> /tmp/sgl-site (its own --target: its pins must not move vLLM's)
# and serve with PYTHONPATH=/tmp/sgl-site:/tmp/site python3 -m sglang.launch_server ...
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=.gpu-wheels
rm -rf "$out"/sglang-all "$out"/s[0-9]* && mkdir -p "$out/sglang-all"
plat=""
for p in manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 manylinux_2_17 \
  manylinux2014 manylinux_2_12 manylinux2010 manylinux_2_5 manylinux1; do plat="$plat --platform ${p}_x86_64"; done
grep -v '^#' "$here/sglang-0.5.17-nodeps.txt" > "$out/sglang-all/requirements.txt"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat \
  -d "$out/sglang-all" -r "$out/sglang-all/requirements.txt"
cd "$out"
( cd sglang-all && sha256sum *.whl > SHA256SUMS )
limit=$((58 * 1024 * 1024)); g=1; used=0; mkdir -p s1
place() { # file size
  if [ $((used + $2)) -gt $limit ]; then g=$((g + 1)); used=0; mkdir -p s$g; fi
  cp "$1" s$g/; used=$((used + $2))
}
for f in $(ls -S sglang-all/*.whl); do
  size=$(stat -c %s "$f")
  if [ "$size" -gt $limit ]; then
    split -b $limit -d "$f" "sglang-all/$(basename "$f").part-"
    for p in "sglang-all/$(basename "$f").part-"*; do place "$p" "$(stat -c %s "$p")"; rm "$p"; done
  else
    place "$f" "$size"
  fi
done
cp sglang-all/SHA256SUMS "s$g/"
cat > "s$g/sglang_install.sh" <<'INSTALL'
#!/usr/bin/env bash
# Joins the split wheels, checks every sum, installs into /tmp/sgl-site (no index, no deps: the list is complete).
set -euo pipefail
cd /tmp/sstage
for first in *.part-00; do
  [ -e "$first" ] || continue
  whl=${first%.part-00}; cat "$whl".part-* > "$whl" && rm "$whl".part-*
done
sha256sum -c --quiet SHA256SUMS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/sgl-site /tmp/sstage/*.whl
echo "installed $(ls /tmp/sstage/*.whl | wc -l) wheels into /tmp/sgl-site"
INSTALL
echo "$g groups in $out/s1 .. $out/s$g"
