#!/usr/bin/env bash
# Wire megatron_taco into an existing Megatron-LM checkout (edits its pretrain_gpt.py).
#   bash scripts/apply_patch.sh /path/to/Megatron-LM
# Decides by content: applies the first patch in patches/ that applies cleanly to the checkout's
# pretrain_gpt.py (checked against core_v0.16.1, core_v0.17.1, core_r0.18.0, core_r0.19.0 and main).
# Nothing is changed when none applies.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
dir=${1:?usage: scripts/apply_patch.sh MEGATRON_LM_DIR}
script="$dir/pretrain_gpt.py"
[ -f "$script" ] || { echo "error: $dir is not a Megatron-LM checkout (no pretrain_gpt.py)" >&2; exit 1; }
info="$dir/megatron/core/package_info.py"
release=unknown
if [ -f "$info" ]; then
  release="$(sed -n 's/^MAJOR = \([0-9]*\).*/\1/p' "$info").$(sed -n 's/^MINOR = \([0-9]*\).*/\1/p' "$info")"
fi
if grep -q "megatron_taco" "$script"; then
  echo "already patched: $script imports megatron_taco"
  exit 0
fi
for patch_file in "$here"/patches/*.patch; do
  if patch --dry-run --silent -p1 -d "$dir" < "$patch_file" >/dev/null 2>&1; then
    patch --silent -p1 -d "$dir" < "$patch_file"
    echo "patched $script with $(basename "$patch_file") (Megatron-LM $release); run it as usual with --taco-* and --mapl-* flags"
    exit 0
  fi
done
echo "error: no patch in patches/ applies to $script (Megatron-LM $release; locally modified?): use python -m megatron_taco.launch, or add these lines before 'from gpt_builders import gpt_builder': $(grep -h '^+[^+]' "$here"/patches/*.patch | sed 's/^+//' | head -3 | paste -sd '|' | sed 's/|/  /g')" >&2
exit 1
