#!/usr/bin/env bash
# Wire megatron_taco into an existing Megatron-LM checkout (edits its pretrain_gpt.py).
#   bash scripts/apply_patch.sh /path/to/Megatron-LM
# Picks the patch for the checkout's release (megatron/core/package_info.py), checks that it applies,
# then applies it. Nothing is changed when the check fails.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
dir=${1:?usage: scripts/apply_patch.sh MEGATRON_LM_DIR}
info="$dir/megatron/core/package_info.py"
[ -f "$info" ] || { echo "error: $dir is not a Megatron-LM checkout (no megatron/core/package_info.py)" >&2; exit 1; }
[ -f "$dir/pretrain_gpt.py" ] || { echo "error: $dir has no pretrain_gpt.py" >&2; exit 1; }
major=$(sed -n 's/^MAJOR = \([0-9]*\).*/\1/p' "$info")
minor=$(sed -n 's/^MINOR = \([0-9]*\).*/\1/p' "$info")
patch_file="$here/patches/megatron-lm-core_r$major.$minor.patch"
if [ ! -f "$patch_file" ]; then
  echo "error: Megatron-LM $major.$minor is not supported; patches exist for: $(ls "$here/patches" | sed 's/megatron-lm-core_r//; s/.patch//' | tr '\n' ' ')" >&2
  echo "       (python -m megatron_taco.launch needs no patch and may work with it)" >&2
  exit 1
fi
if grep -q "megatron_taco" "$dir/pretrain_gpt.py"; then
  echo "already patched: $dir/pretrain_gpt.py imports megatron_taco"
  exit 0
fi
if ! patch --dry-run --silent -p1 -d "$dir" < "$patch_file" >/dev/null 2>&1; then
  echo "error: $(basename "$patch_file") does not apply to $dir/pretrain_gpt.py (locally modified?)." >&2
  echo "       Use python -m megatron_taco.launch instead, or add these lines before 'from gpt_builders import gpt_builder':" >&2
  grep '^+[^+]' "$patch_file" | sed 's/^+/         /' >&2
  exit 1
fi
patch --silent -p1 -d "$dir" < "$patch_file"
echo "patched $dir/pretrain_gpt.py with $(basename "$patch_file"); run it as usual with --transformer-impl local --taco-mode fp8-ash"
