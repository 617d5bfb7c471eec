"""One vLLM process start, as far as the plugin sees it (run by tests/test_plugin.py in a
subprocess): vLLM's own plugin loader (``vllm.plugins.load_general_plugins``, from the real
wheel's files in TREE), then the import of ``vllm.models.minimax_m3.nvidia.model`` from TREE
and the construction of one of its layer classes under the KV-cache dtype DTYPE.

What a CPU cannot import is stood in, and only that: the vLLM modules the model file imports
(they reach vLLM's CUDA kernel library and its server dependencies at import time) become
empty modules, and vLLM's config accessor answers DTYPE (building a ``VllmConfig`` needs a
device platform). The GPU run in docs/plugin.md starts the real engine instead.

    python plugin_harness.py TREE DTYPE CLASS  ->  one JSON line on stdout's last line
"""

import ast
import json
import sys
import types
from pathlib import Path

tree, dtype, class_name = sys.argv[1:4]
sys.path.insert(0, tree)
model = Path(tree, "vllm", "models", "minimax_m3", "nvidia", "model.py")
facts: dict[str, object] = {}

from vllm.plugins import load_general_plugins  # the real loader, from TREE

load_general_plugins()
facts["loaded_at_plugin_time"] = sorted(m for m in ("libcst", "typer", "rich", "rewriter.apply") if m in sys.modules)
facts["hooks"] = [type(f).__name__ for f in sys.meta_path if type(f).__module__ == "mm3_codemod.plugin"]


def stand_in(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    def name(attr: str):  # any name it imports: a no-op; not a module's own dunder (``inspect`` reads ``__file__``)
        if attr.startswith("__"):
            raise AttributeError(attr)
        return lambda *a, **k: None

    module.__getattr__ = name
    module.__path__ = []
    return module


imported = {
    node.module if isinstance(node, ast.ImportFrom) else alias.name
    for node in ast.walk(ast.parse(model.read_bytes()))
    if isinstance(node, (ast.Import, ast.ImportFrom))
    for alias in node.names
}
for name in sorted(n for n in imported if n and n.startswith("vllm.") and not n.startswith("vllm.models.")):
    sys.modules.setdefault(name, stand_in(name))
if "vllm" in imported or any(n == "vllm" for n in imported):  # from vllm import _custom_ops
    sys.modules.setdefault("vllm._custom_ops", stand_in("vllm._custom_ops"))
config = stand_in("vllm.config")
config.get_current_vllm_config_or_none = lambda: types.SimpleNamespace(
    cache_config=types.SimpleNamespace(cache_dtype=dtype)
)
sys.modules["vllm.config"] = config

import vllm.models.minimax_m3.nvidia.model as module

facts["file"] = module.__file__
cls = getattr(module, class_name)
facts["has_write_method"] = any("_insert_kv" in name or "write" in name for name in vars(cls))
config_ns = types.SimpleNamespace(
    num_attention_heads=8, num_key_value_heads=2, head_dim=64, hidden_size=512,
    sparse_attention_config={"sparse_index_dim": 32, "sparse_num_index_heads": 2},
)
cache = types.SimpleNamespace(cache_dtype=dtype)
try:
    layer = cls.__new__(cls)
    cls.__init__(layer, config_ns, cache, types.SimpleNamespace(model_config=None))
    facts["constructed"] = True
    facts["fp8_flag"] = {k: v for k, v in vars(layer).items() if isinstance(v, bool)}
except Exception as exc:
    facts["constructed"] = False
    facts["error"] = f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
print(json.dumps(facts))
