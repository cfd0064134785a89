"""The package's shape: imports point one way (engine below backends below the app and the
CLI), with no circle anywhere in kvchat/, and the light commands never import torch."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "kvchat"
ENGINE = ROOT / "engine"


def module_name(path: Path) -> str:
    if path.is_relative_to(ENGINE):
        parts = ("kvchat", "engine") + path.relative_to(ENGINE).with_suffix("").parts
    else:
        parts = ("kvchat",) + path.relative_to(PKG).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources() -> dict[str, Path]:
    files = [p for p in PKG.rglob("*.py") if "engine" not in p.relative_to(PKG).parts[:1]]
    files += list(ENGINE.rglob("*.py"))
    return {module_name(p): p for p in files}


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every kvchat module `path` imports, at module level or inside a function."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def graph() -> dict[str, set[str]]:
    src = sources()
    known = set(src)
    g = {name: imports(name, path, known) for name, path in src.items()}
    # importing a package runs its __init__, which is not an edge of the package's own modules
    return {name: {t for t in deps if not name.startswith(t + ".")} for name, deps in g.items()}


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(g.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (c := visit(m)):
                return c
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(g):
        if n not in state and (c := visit(n)):
            return c
    return None


def test_no_import_circle_in_kvchat():
    assert find_cycle(graph()) is None, " -> ".join(find_cycle(graph()))


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_layers_point_one_way():
    g = graph()
    for name, deps in g.items():
        if name.startswith("kvchat.engine"):
            assert all(d.startswith("kvchat.engine") or d == "kvchat" for d in deps), (name, deps)
        if name.startswith("kvchat.backends"):   # the words (text.py: shown, redact) sit below them too
            assert all(d.startswith(("kvchat.engine", "kvchat.backends")) or d in ("kvchat", "kvchat.text")
                       for d in deps), (name, deps)
        if name == "kvchat.cli.args":
            assert all(d.startswith("kvchat.engine") or d in ("kvchat", "kvchat.cli") for d in deps), (name, deps)
    for path in list(ENGINE.rglob("*.py")) + list((PKG / "backends").rglob("*.py")):
        assert "textual" not in path.read_text(encoding="utf-8"), f"{path} mentions textual"


def in_room(name: str, *rooms: str) -> bool:
    return any(name == f"kvchat.{r}" or name.startswith(f"kvchat.{r}.") for r in rooms)


VOCABULARY = ("keys", "commands", "latency", "text")   # the shared words, kept low


def test_widgets_and_screens_never_reach_up_into_the_chat_the_app_or_the_cli():
    """Widgets and modal screens draw what they are given: nothing of the chat's state, the
    App or the command line."""
    for name, deps in graph().items():
        if in_room(name, "widgets", "screens"):
            up = sorted(d for d in deps if in_room(d, "chat", "app", "cli"))
            assert not up, f"{name} imports {up}"


def test_the_store_imports_only_the_engine_and_the_shared_vocabulary():
    for name, deps in graph().items():
        if in_room(name, "store"):
            other = sorted(d for d in deps if not (in_room(d, "engine", "store", *VOCABULARY) or d == "kvchat"))
            assert not other, f"{name} imports {other}"


def test_the_vocabulary_sits_below_every_room():
    rooms = ("app", "chat", "cli", "widgets", "screens", "bench", "backends")
    for name, deps in graph().items():
        if in_room(name, *VOCABULARY):
            up = sorted(d for d in deps if in_room(d, *rooms))
            assert not up, f"{name} imports {up}"


def test_the_top_level_holds_at_most_eight_modules():
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert len(top) <= 8, top


def test_help_and_info_do_not_import_torch():
    code = ("import sys, contextlib, io\n"
            "from kvchat.cli.command import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    rc = main(['info', '--model', 'llama-3.1-8b'])\n"
            "assert rc == 0, rc\n"
            "print('torch' in sys.modules, 'textual' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]


def test_every_backend_implements_the_whole_protocol():
    """A method added to Backend or Chat must be added to every implementation (the vLLM one
    is only exercised against a live server, so this catches a gap without one)."""
    from kvchat.backends import local, protocol, vllm
    for proto, classes in ((protocol.Backend, (local.LocalBackend, vllm.VllmBackend)),
                           (protocol.Chat, (local.LocalChat, vllm.VllmChat))):
        members = {n for n in proto.__protocol_attrs__} if hasattr(proto, "__protocol_attrs__") else {
            n for n in vars(proto) if not n.startswith("_")}
        for cls in classes:
            missing = sorted(n for n in members if not n.startswith("_") and not hasattr(cls, n)
                             and n not in getattr(cls, "__annotations__", {}) and n != "capabilities")
            assert not missing, f"{cls.__name__} lacks {missing}"
