"""The package layering (../shared/ARCHITECTURE.md), read from the source: every import,
function-level ones included, between west's packages and shared modules."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WEST = ROOT / "west"

# who must not import whom (packages and shared top-level modules of west)
FORBIDDEN = {
    "models": {"data", "train", "checkpoint", "infer", "bench", "bin"},
    "data": {"models", "train", "checkpoint", "infer", "bench", "bin"},
    "checkpoint": {"train", "infer", "data", "bench", "bin"},
    "infer": {"train", "bench", "bin"},
    "ranks": {"train", "checkpoint", "models", "data"},
}


def west_imports(path: Path) -> set[str]:
    """Absolute ``west.*`` modules a file imports, at any depth of its code."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("west.")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "west":
                found |= {f"west.{a.name}" for a in node.names}
            elif node.module.startswith("west."):
                found.add(node.module)
    return found


def unit(module: str) -> str:
    """west.models.conformer -> models; west.shapes -> shapes; west itself -> west."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def graph(files) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for f in files:
        src = module_name(f)
        edges.setdefault(unit(src), set()).update(unit(m) for m in west_imports(f) if unit(m) != unit(src))
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str]:
    """One cycle of the graph as a path (first node repeated at the end), or []."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str]:
        state[n] = 1
        stack.append(n)
        for m in sorted(edges.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (c := visit(m)):
                return c
        state[n] = 2
        stack.pop()
        return []

    for n in sorted(edges):
        if n not in state and (c := visit(n)):
            return c
    return []


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a"}}) == []


def test_no_forbidden_imports():
    edges = graph(WEST.rglob("*.py"))
    bad = {(a, b) for a, banned in FORBIDDEN.items() for b in edges.get(a, set()) & banned}
    assert not bad, f"forbidden package imports: {sorted(bad)}"


def test_no_product_module_imports_the_lab():
    """west.lab (host clocks, phase marks, operator timings...) is apart: product code never imports
    it, at any depth of its code; tools and tests may."""
    edges = graph(WEST.rglob("*.py"))
    assert not {a for a, bs in edges.items() if "lab" in bs and a != "lab"}, edges


def test_a_plain_west_train_run_imports_no_lab_module(tmp_path_factory, corpus):
    """A tiny west-train run in its own process: afterwards no west.lab module is loaded (so no host
    clock was read), and the step records hold none of the lab's figures."""
    import json
    import subprocess
    import sys

    from helpers.e2e import subprocess_env, tiny_llm, train_argv, write_lists

    d = tmp_path_factory.mktemp("plain")
    lists = write_lists(corpus["rows"], d / "lists", 6)
    argv = train_argv(tiny_llm(tmp_path_factory), lists.jsonl, d / "run", "--batch_type", "pack",
                      "--pack_tokens", "200", "--max_steps", "2")
    code = ("import sys, json; from west.bin.train import main; rc = main(json.loads(sys.argv[1])); "
            "print(json.dumps([rc, sorted(m for m in sys.modules if m.startswith('west.lab'))]))")
    out = subprocess.run([sys.executable, "-c", code, json.dumps([str(a) for a in argv])], capture_output=True,
                         text=True, timeout=600, cwd=ROOT, env=subprocess_env())
    assert out.returncode == 0, out.stderr[-3000:]
    rc, lab = json.loads(out.stdout.strip().splitlines()[-1])
    assert rc == 0 and lab == []
    steps = [json.loads(line) for line in (d / "run" / "train_log.jsonl").read_text().splitlines() if line.strip()]
    assert steps and not any({"phase_marks", "host_cpu_ms", "steal_ms"} & set(s) for s in steps)


def test_no_cycle_between_packages():
    """west.config is the config tree's root: it composes each package's section (dataclass
    leaves such as train/config.py) and packages read the composed tree, so it is left out."""
    edges = {a: bs - {"config"} for a, bs in graph(WEST.rglob("*.py")).items() if a != "config"}
    assert find_cycle(edges) == []


def test_no_cycle_inside_checkpoint():
    files = list((WEST / "checkpoint").glob("*.py"))
    edges: dict[str, set[str]] = {}
    for f in files:
        src = module_name(f)
        edges[src] = {m for m in west_imports(f) if m.startswith("west.checkpoint.") and m != src}
    assert find_cycle(edges) == []


def test_checkpoint_tools_do_not_reach_into_training():
    for name in ("average_checkpoints.py", "convert_wenet_checkpoint.py"):
        assert not {m for m in west_imports(ROOT / "tools" / name) if unit(m) == "train"}, name


def function_level_imports(path: Path) -> list[tuple[int, str]]:
    """(line, text) of each import inside a function of ``path``."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out = []
    for node in ast.walk(ast.parse("\n".join(lines))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for sub in ast.walk(node):
                if isinstance(sub, (ast.Import, ast.ImportFrom)):
                    out.append((sub.lineno, lines[sub.lineno - 1]))
    return sorted(set(out))


def test_function_level_imports_say_why():
    """An import inside a function avoids a heavy or optional import (or a cycle); it says so in
    a trailing comment on its line (``# heavy``, ``# optional``, ...)."""
    silent = [f"{f.relative_to(ROOT)}:{n}: {text.strip()}" for f in sorted(WEST.rglob("*.py"))
              for n, text in function_level_imports(f) if "#" not in text]
    assert not silent, "function-level imports without a reason:\n" + "\n".join(silent)


def test_cuda_allocator_defaults_respect_the_user(monkeypatch):
    from west.ranks import cuda_allocator_defaults

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    cuda_allocator_defaults()
    assert __import__("os").environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    cuda_allocator_defaults()
    assert __import__("os").environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:False")
    cuda_allocator_defaults()
    assert "PYTORCH_CUDA_ALLOC_CONF" not in __import__("os").environ


def test_packing_for_hugging_face_users_imports_no_speech_stack():
    """west.packing and west.hf serve text-only users: importing them loads none of west's speech,
    logging or plotting dependencies (soundfile and soxr are left out: transformers' Trainer imports them)."""
    import subprocess
    import sys

    code = ("import sys, west.packing, west.hf; print(sorted(m for m in ('kaldiio', 'kaldi_native_fbank', 'tensorboard', "
            "'matplotlib', 'west.data.features', 'west.train') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_no_module_cycle_inside_a_package_lazy_imports_included():
    """Module by module inside models and data, function-level imports counted too (a lazy import
    that closes a circle is still a circle); TYPE_CHECKING-only imports are annotations, not imports."""
    for package in ("models", "data"):
        edges: dict[str, set[str]] = {}
        for f in (WEST / package).glob("*.py"):
            tree = ast.parse(f.read_text(encoding="utf-8"))
            typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                           and getattr(node.test, "id", "") == "TYPE_CHECKING" for n in ast.walk(node)}
            mods = set()
            for node in ast.walk(tree):
                if id(node) in typing_only:
                    continue
                if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("west."):
                    mods.add(node.module)
                elif isinstance(node, ast.Import):
                    mods |= {a.name for a in node.names if a.name.startswith("west.")}
            edges[module_name(f)] = {m for m in mods if m.startswith(f"west.{package}.")}
        assert find_cycle(edges) == [], package
