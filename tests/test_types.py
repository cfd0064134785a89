"""The type checker (mypy, configured in pyproject.toml) over engine/ and kvchat/: part of the
test command, so a None reaching an int field, or an unannotated function in a seam module,
fails `make test` as it fails here.

mypy rather than pyright: it installs from PyPI as a Python package (pyright's PyPI wrapper
downloads Node at first run), its per-module options give the seams strict checking and the
rest the default level in one config, and its plugin reads dataclasses' generated __init__.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# one worker under pytest-xdist (`make test`): both tests share the module fixture's cold run
pytestmark = pytest.mark.xdist_group("mypy")


def mypy(*args: str) -> subprocess.CompletedProcess[str]:
    """mypy as `make test` runs it: the repository's config (the caller names the cache)."""
    return subprocess.run([sys.executable, "-m", "mypy", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


def shadowed(tmp_path: Path, module: str, old: str, new: str) -> tuple[str, str]:
    """--shadow-file arguments that check `module` (a path under the repository) with `old`
    replaced by `new`."""
    source = (ROOT / module).read_text(encoding="utf-8")
    assert old in source, f"{module} no longer has {old!r}: update this test"
    shadow = tmp_path / Path(module).name
    shadow.write_text(source.replace(old, new, 1), encoding="utf-8")
    return str(module), str(shadow)


@pytest.fixture(scope="module")
def checked(tmp_path_factory) -> tuple[subprocess.CompletedProcess[str], Path]:
    """One cold run over the tree into a cache of the module's own (as a fresh clone's `make
    test` runs it): its result, and the cache the shadowed run below starts from, so that run
    checks only what the shadows change instead of the whole tree again (17 s of 35 on CI)."""
    cache = tmp_path_factory.mktemp("mypy") / "cache"
    return mypy("--cache-dir", str(cache)), cache


def test_engine_and_kvchat_pass_the_type_checker(checked):
    out, _ = checked
    assert "No module named mypy" not in out.stderr, "mypy is missing: pip install -e '.[test]'"
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Success: no issues found" in out.stdout


def test_a_none_in_an_int_field_and_an_untyped_seam_fail_the_check_an_untyped_widget_does_not(tmp_path, checked):
    """One run over three changed files. A server that cannot tell the reused tokens leaves
    PrefillEvent.reused_tokens None: a Session that kept it as the prompt's size (an int) is an
    error; so is an unannotated function in a seam module (kvchat/chat/, strict), while the
    same function in a widget (the default level) passes.

    The run starts from a copy of the tree's warm cache, so it checks what the shadows change
    (1.6 s, not a second cold run of 40). Each shadow differs in size from its original (the
    session's same-length change gets a trailing comment), so no mypy can take the original's
    cached result for it; and the widget's shadow reveals a type: its note shows the shadow
    was checked, not read from the cache, so its passing means something."""
    untyped = "\n\ndef untyped(x):\n    return x\n"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    session = shadowed(tmp_path / "a", "kvchat/chat/session.py", "self.prompt_tokens = p.prefill.prompt_tokens",
                       "self.prompt_tokens = p.prefill.reused_tokens  # shadowed")
    relay = shadowed(tmp_path / "b", "kvchat/chat/relay.py", "UI_SHARE = 0.03", "UI_SHARE = 0.03" + untyped)
    layout = shadowed(tmp_path, "kvchat/widgets/layout.py", 'CHAT = "chat"',
                      'CHAT = "chat"' + untyped + "\n\nreveal_type(untyped)\n")
    cache = tmp_path / "cache"
    shutil.copytree(checked[1], cache)
    out = mypy("--cache-dir", str(cache), "--shadow-file", *session, "--shadow-file", *relay,
               "--shadow-file", *layout)
    assert out.returncode == 1
    assert any(line.startswith("kvchat/widgets/layout.py") and "Revealed type" in line
               for line in out.stdout.splitlines()), out.stdout
    errors = [line for line in out.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 2, out.stdout
    assert errors[0].startswith("kvchat/chat/relay.py") and "Function is missing a type annotation" in errors[0]
    assert errors[1].startswith("kvchat/chat/session.py")
    assert 'expression has type "int | None", variable has type "int"' in errors[1]
