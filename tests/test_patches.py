"""patches/: structure, the megatron_taco names they call, and scripts/apply_patch.sh's refusals.

Applying it to real Megatron-LM releases runs on the GPU machine (scripts/megatron_lm_check.sh): the
Megatron-LM sources are not part of this repository. Here a checkout stand-in has their lines around the insertion point.
"""

import glob
import importlib
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATCHES = sorted(glob.glob(os.path.join(ROOT, "patches", "*.patch")))


def test_one_patch_for_every_release():
    assert [os.path.basename(p) for p in PATCHES] == ["megatron-lm.patch"]


@pytest.mark.parametrize("path", PATCHES, ids=os.path.basename)
def test_patch_is_a_well_formed_unified_diff_of_pretrain_gpt(path):
    lines = open(path).read().splitlines()
    assert lines[0] == "--- a/pretrain_gpt.py" and lines[1] == "+++ b/pretrain_gpt.py"
    i = 2
    while i < len(lines):
        match = re.fullmatch(r"@@ -(\d+),(\d+) \+(\d+),(\d+) @@.*", lines[i])
        assert match, f"bad hunk header: {lines[i]!r}"
        old_len, new_len = int(match.group(2)), int(match.group(4))
        body = []
        i += 1
        while i < len(lines) and not lines[i].startswith("@@"):
            body.append(lines[i])
            i += 1
        assert all(line[:1] in (" ", "+", "-") or line == "" for line in body)
        assert sum(1 for line in body if not line.startswith("+")) == old_len
        assert sum(1 for line in body if not line.startswith("-")) == new_len


@pytest.mark.parametrize("path", PATCHES, ids=os.path.basename)
def test_every_megatron_taco_name_the_patch_calls_exists(path):
    added = [line[1:] for line in open(path).read().splitlines() if line.startswith("+") and not line.startswith("+++")]
    imports = [re.match(r"from (megatron_taco[\w.]*) import (\w+)", line) for line in added]
    imports = [m for m in imports if m]
    assert imports, "the patch must import its hook from megatron_taco"
    for match in imports:
        assert callable(getattr(importlib.import_module(match.group(1)), match.group(2)))


# The lines around the patch's insertion point in Megatron-LM 0.16-0.19's pretrain_gpt.py.
PRETRAIN_GPT_HEAD = (
    "from typing import List, Optional, Tuple\n\nimport torch\n\nfrom gpt_builders import gpt_builder\n"
    "from megatron.core import mpu\nfrom megatron.core.datasets.blended_megatron_dataset_builder "
    "import BlendedMegatronDatasetBuilder\nprint('training')\n"
)


def _fake_checkout(tmp_path, minor, body=PRETRAIN_GPT_HEAD):
    (tmp_path / "megatron" / "core").mkdir(parents=True)
    (tmp_path / "megatron" / "core" / "package_info.py").write_text(f"MAJOR = 0\nMINOR = {minor}\nPATCH = 0\n")
    (tmp_path / "pretrain_gpt.py").write_text(body)
    return tmp_path


def _apply(directory):
    return subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", "apply_patch.sh"), str(directory)],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("minor", [16, 17, 18, 19])
def test_apply_patch_decides_by_content_and_refuses_a_second_application(tmp_path, minor):
    checkout = _fake_checkout(tmp_path, minor)
    proc = _apply(checkout)
    assert proc.returncode == 0 and f"(Megatron-LM 0.{minor})" in proc.stdout, proc.stderr
    text = (checkout / "pretrain_gpt.py").read_text()
    assert text.index("install_hooks()") < text.index("from gpt_builders import gpt_builder")
    again = _apply(checkout)
    assert again.returncode == 0 and "already patched" in again.stdout
    assert (checkout / "pretrain_gpt.py").read_text() == text


def test_apply_patch_refuses_what_it_cannot_patch_and_changes_nothing(tmp_path):
    checkout = _fake_checkout(tmp_path, 19, body="# not Megatron-LM's pretrain_gpt.py\n")
    proc = _apply(checkout)
    assert proc.returncode != 0 and "no patch in patches/ applies" in proc.stderr and len(proc.stderr.splitlines()) == 1
    assert (checkout / "pretrain_gpt.py").read_text() == "# not Megatron-LM's pretrain_gpt.py\n"


def test_apply_patch_refuses_a_directory_that_is_not_a_checkout(tmp_path):
    proc = _apply(tmp_path)
    assert proc.returncode != 0 and "not a Megatron-LM checkout (no pretrain_gpt.py)" in proc.stderr
