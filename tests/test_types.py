"""The type checker (mypy, configured in pyproject.toml) over engine/ and kvchat/: part of the
test command, so a None reaching an int field, or an unannotated function in a seam module,
fails `make test` as it fails here.

mypy rather than pyright: it installs from PyPI as a Python package (pyright's PyPI wrapper
downloads Node at first run), its per-module options give the seams strict checking and the
rest the default level in one config, and its plugin reads dataclasses' generated __init__.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def mypy(*args: str) -> subprocess.CompletedProcess[str]:
    """mypy as `make test` runs it: the repository's config, its cache."""
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


def test_engine_and_kvchat_pass_the_type_checker():
    out = mypy()
    assert "No module named mypy" not in out.stderr, "mypy is missing: pip install -e '.[test]'"
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Success: no issues found" in out.stdout


def test_a_none_in_an_int_field_and_an_untyped_seam_fail_the_check_an_untyped_widget_does_not(tmp_path):
    """One run over three changed files. A server that cannot tell the reused tokens leaves
    PrefillEvent.reused_tokens None: a Session that kept it as the prompt's size (an int) is an
    error; so is an unannotated function in a seam module (kvchat/chat/, strict), while the
    same function in a widget (the default level) passes."""
    untyped = "\n\ndef untyped(x):\n    return x\n"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    session = shadowed(tmp_path / "a", "kvchat/chat/session.py", "self.prompt_tokens = p.prefill.prompt_tokens",
                       "self.prompt_tokens = p.prefill.reused_tokens")
    relay = shadowed(tmp_path / "b", "kvchat/chat/relay.py", "UI_SHARE = 0.03", "UI_SHARE = 0.03" + untyped)
    layout = shadowed(tmp_path, "kvchat/widgets/layout.py", 'CHAT = "chat"', 'CHAT = "chat"' + untyped)
    # its own cache: a shadowed file the size of the original is read from the cache as unchanged
    out = mypy("--cache-dir", str(tmp_path / "cache"), "--shadow-file", *session, "--shadow-file", *relay,
               "--shadow-file", *layout)
    assert out.returncode == 1
    errors = [line for line in out.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 2, out.stdout
    assert errors[0].startswith("kvchat/chat/relay.py") and "Function is missing a type annotation" in errors[0]
    assert errors[1].startswith("kvchat/chat/session.py")
    assert 'expression has type "int | None", variable has type "int"' in errors[1]
