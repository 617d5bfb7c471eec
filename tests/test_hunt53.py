"""Hunt 53: what runs when the layer class is made. vLLM builds the class a class decorator, a metaclass or a base's
``__init_subclass__`` leaves; the bypass and its proof (the stand-in) read the class's own ``def``s. One that
replaced the write method with a no-op had ``check`` say ``patched`` (the fp8 cache never written)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_hunt47 import FORK_ERA, NATIVE, PATCHED, _edited

from rewriter.apply import plan_file

CLASS = "class MiniMaxM3SparseAttention(nn.Module, AttentionLayerBase):\n"
NATIVE_CLASS = "class MiniMaxM3SparseAttention(nn.Module):\n"
NO_OP = "lambda self, *args, **kwargs: None"

# name -> (what stands before the class line, what the class line becomes: "{}" is its bases)
MAKERS = {
    "a decorator sets the write method": (
        f"def skip(cls):\n    cls._insert_kv = {NO_OP}\n    return cls\n\n\n@skip\n",
        "{}",
    ),
    "a decorator setattr()s it": (
        f"def skip(cls):\n    setattr(cls, '_insert_kv', {NO_OP})\n    return cls\n\n\n@skip\n",
        "{}",
    ),
    "a decorator returns a subclass": (
        "def eager(cls):\n    class Eager(cls):\n        def _insert_kv(self, *a):\n            return None\n\n"
        "    return Eager\n\n\n@eager\n",
        "{}",
    ),
    "a decorator factory's decorator sets it": (
        f"def skip(name):\n    def deco(cls):\n        cls._insert_kv = {NO_OP}\n        return cls\n\n    return deco\n\n\n"
        '@skip("x")\n',
        "{}",
    ),
    "a base's __init_subclass__ sets it": (
        f"class Mixin:\n    def __init_subclass__(cls, **kw):\n        super().__init_subclass__(**kw)\n"
        f"        cls._insert_kv = {NO_OP}\n\n\n",
        "{}, Mixin",
    ),
    "a metaclass rewrites the namespace": (
        "class Meta(type(nn.Module)):\n    def __new__(mcs, name, bases, ns):\n"
        f"        ns['_insert_kv'] = {NO_OP}\n        return super().__new__(mcs, name, bases, ns)\n\n\n",
        "{}, metaclass=Meta",
    ),
    "a metaclass pops from it": (
        "class Meta(type(nn.Module)):\n    def __new__(mcs, name, bases, ns):\n"
        "        ns.pop('_insert_kv')\n        return super().__new__(mcs, name, bases, ns)\n\n\n",
        "{}, metaclass=Meta",
    ),
    "an imported decorator the file does not define": ("from profiling import traced\n\n\n@traced\n", "{}"),
}
# the same machinery, leaving the class as it is: no refusal
INERT = {
    "an identity registry decorator": (
        "REGISTRY = {}\n\n\ndef register(cls):\n    REGISTRY[cls.__name__] = cls\n    return cls\n\n\n@register\n",
        "{}",
    ),
    "a registry factory": (
        "REGISTRY = {}\n\n\ndef register(name):\n    def deco(cls):\n        REGISTRY[name] = cls\n"
        '        return cls\n\n    return deco\n\n\n@register("sparse")\n',
        "{}",
    ),
    "a base's registering __init_subclass__": (
        "class Registered:\n    seen = []\n\n    def __init_subclass__(cls, **kw):\n        super().__init_subclass__(**kw)\n"
        "        Registered.seen.append(cls)\n\n\n",
        "{}, Registered",
    ),
    "a metaclass that hands the namespace on": (
        "class Meta(type(nn.Module)):\n    def __new__(mcs, name, bases, ns):\n        return super().__new__(mcs, name, bases, ns)\n\n\n",
        "{}, metaclass=Meta",
    ),
    "vLLM's own decorator": (
        "from vllm.compilation.decorators import support_torch_compile\n\n\n@support_torch_compile\n",
        "{}",
    ),
}


def _made(source: str, class_line: str, before: str, bases: str) -> str:
    inner = class_line.removeprefix("class MiniMaxM3SparseAttention(").removesuffix("):\n")
    return _edited(
        source, [(class_line, before + f"class MiniMaxM3SparseAttention({bases.format(inner)}):\n")]
    )


def _states(tmp_path: Path, source: str) -> list[tuple[str, str]]:
    path = tmp_path / "model.py"
    path.write_text(source)
    return [
        (s.state.value, s.reason) for s in plan_file(path).sites if s.class_name == "MiniMaxM3SparseAttention"
    ]


@pytest.mark.parametrize("case", sorted(MAKERS))
@pytest.mark.parametrize("base", ["patched", "fork-era", "native"])
def test_a_class_that_is_made_otherwise_is_refused(tmp_path: Path, case: str, base: str) -> None:
    source, line = {
        "patched": (PATCHED, CLASS),
        "fork-era": (FORK_ERA, CLASS),
        "native": (NATIVE, NATIVE_CLASS),
    }[base]
    assert [state for state, _ in _states(tmp_path, source)] != ["unsupported"]  # the control
    ((state, reason),) = _states(tmp_path, _made(source, line, *MAKERS[case]))
    assert (
        state == "unsupported" and "MiniMaxM3SparseAttention" in reason and "Nothing was changed" in reason
    ), reason


@pytest.mark.parametrize("case", sorted(INERT))
def test_machinery_that_leaves_the_class_as_it_is_is_no_refusal(tmp_path: Path, case: str) -> None:
    assert [state for state, _ in _states(tmp_path, _made(PATCHED, CLASS, *INERT[case]))] == ["patched"]


IMPORT = "from vllm import _custom_ops as ops\n"
TRIED = f"try:\n    {IMPORT}except ImportError:  # a CPU build\n    import vllm._custom_ops as ops\n"


def test_an_import_in_a_module_level_try_is_the_modules_own(tmp_path: Path) -> None:
    """The write names ``ops`` as the file binds it: a ``try`` whose every import binds it to ``vllm._custom_ops``
    does, for the code ``run`` writes into a method (it was refused as "an import in a function")."""
    path = tmp_path / "model.py"
    path.write_text(_edited(FORK_ERA, [(IMPORT, TRIED)]))
    result = plan_file(path)
    assert result.status.value == "needs-rewrite" and result.new is not None, [s.reason for s in result.sites]
    assert b"ops.reshape_and_cache_flash(" in result.new
    path.write_text(_edited(FORK_ERA, [(IMPORT, TRIED.replace("import vllm._custom_ops as ops", "ops = None"))]))
    assert "vllm._custom_ops" in " ".join(s.reason for s in plan_file(path).sites)  # bound to two things: not known
