"""Stop 50: programs that are the same as a supported form, refused before (each with its base), and what must
still be refused beside them, as small edits of the fixtures through the whole command (``check --json``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_hunt47 import NATIVE, PATCHED, _edited, _states, refused_but_not_its_base

FLAG = 'self._fp8_kv = "fp8" in self.kv_cache_dtype'
DTYPE = '            cache_config.cache_dtype if cache_config is not None else "auto"\n'

# The flag read from what ``self.kv_cache_dtype`` is read from, ``cache_config.cache_dtype`` (there wherever the
# dtype is read from it): the same flag as the fixture's.
ATTRIBUTE = 'cache_config.cache_dtype.startswith("fp8")'
FROM_CACHE_CONFIG = {
    "the dtype's attribute": ATTRIBUTE,
    "getattr of it": '"fp8" in getattr(cache_config, "cache_dtype", "auto")',
    "tested for None first": 'cache_config is not None and cache_config.cache_dtype.startswith("fp8")',
    "a conditional of it": '"fp8" in (cache_config.cache_dtype if cache_config else "auto")',
    "a slice of it": 'cache_config.cache_dtype[:3] == "fp8"',  # (hunt 50's h57, of self.kv_cache_dtype)
}


@pytest.mark.parametrize("case", sorted(FROM_CACHE_CONFIG))
def test_a_flag_read_from_the_cache_config_is_the_flag(tmp_path: Path, case: str) -> None:
    path = tmp_path / "model.py"
    path.write_text(_edited(PATCHED, [(FLAG, f"self._fp8_kv = {FROM_CACHE_CONFIG[case]}")]))
    assert _states(path)[-1] == "patched"


# The dtype read otherwise: ``cache_config.cache_dtype`` is not what ``self.kv_cache_dtype`` holds.
NOT_THE_DTYPE = {
    # the cache dtype taken from it under a test of something else: where that fails, the two differ
    "under another test": [(DTYPE, '            cache_config.cache_dtype if quant_config is None else "auto"\n')],
    # the object rebound after the dtype is read from it, before the flag is
    "the object rebound": [
        (DTYPE + "        )\n", DTYPE + '        )\n        cache_config = dataclasses.replace(cache_config, cache_dtype="fp8")\n')
    ],
    # the dtype from elsewhere
    "another source": [(DTYPE, '            "auto"\n')],
}


@pytest.mark.parametrize("case", sorted(NOT_THE_DTYPE))
def test_a_flag_read_from_the_cache_config_of_another_dtype_is_refused(tmp_path: Path, case: str) -> None:
    base = _edited(PATCHED, [(FLAG, f"self._fp8_kv = {ATTRIBUTE}")])
    refused_but_not_its_base(tmp_path / "model.py", base, NOT_THE_DTYPE[case])


FORK_ERA = (Path(__file__).parent.parent / "fixtures" / "fork_era" / "model.py").read_text()
PROJECTION = "        qkv, _ = self.qkv_proj(hidden_states)\n        num_tokens = qkv.shape[0]\n"


def test_an_import_in_a_function_is_no_name_for_the_write(tmp_path: Path) -> None:
    """``vllm._custom_ops`` imported in the forward alone (hunt 50's G3): a write method ``run`` wrote with ``ops.`` would
    raise NameError, so the site is refused, saying where the import must be."""
    path = tmp_path / "model.py"
    path.write_text(FORK_ERA)
    assert _states(path)[-1] == "needs-bypass"  # the control
    local = "        from vllm import _custom_ops as ops\n"
    edited = _edited(FORK_ERA, [("from vllm import _custom_ops as ops\n", ""), (PROJECTION, local + PROJECTION)])
    path.write_text(edited)
    from conftest import cli

    proc = cli("run", str(path))
    assert proc.returncode == 2 and "no statement of the module's own imports `vllm._custom_ops`" in proc.stderr
    assert path.read_text() == edited


MAIN_WRITE = "        ops.reshape_and_cache_flash(\n            key.view(-1, self.num_kv_heads, self.head_dim),\n"
ALIAS = [
    ("from vllm import _custom_ops as ops\n",
     "from vllm import _custom_ops as ops\nfrom vllm._custom_ops import reshape_and_cache_flash as write_kv_cache\n"),
    (MAIN_WRITE, MAIN_WRITE.replace("ops.reshape_and_cache_flash", "write_kv_cache")),
]


def test_a_write_through_an_alias_of_the_op_is_the_write(tmp_path: Path) -> None:
    """The main write through an import alias of the reshape op (hunt 50's G4) is read as the write: the same
    program is patched, and a kv-cache dtype the kernel would read as another is refused as without the alias."""
    path = tmp_path / "model.py"
    path.write_text(_edited(PATCHED, ALIAS))
    assert _states(path)[-1] == "patched"
    literal = ("            main_slot_mapping,\n            self.kv_cache_dtype,\n", '            main_slot_mapping,\n            "fp8",\n')
    path.write_text(_edited(PATCHED, [*ALIAS, literal]))
    assert _states(path)[-1] == "unsupported"


PLACEHOLDER = "        self.kv_cache = torch.tensor([])  # replaced by bind_kv_cache\n"
UNBIND = "        key_cache, value_cache = self.kv_cache.unbind(1)\n"
CAPTURED = {
    "the main cache": [(PLACEHOLDER, PLACEHOLDER + "        self._main_cache = self.kv_cache\n"),
                       (UNBIND, UNBIND.replace("self.kv_cache", "self._main_cache"))],
    "both caches in a tuple": [
        (PLACEHOLDER, PLACEHOLDER + "        self._caches = (self.kv_cache, self.indexer.index_cache.kv_cache)\n"),
        (UNBIND, UNBIND.replace("self.kv_cache", "self._caches[0]")),
    ],
}


@pytest.mark.parametrize("case", sorted(CAPTURED))
def test_a_cache_held_since_init_is_refused_and_fails_the_semantic_level(tmp_path: Path, case: str) -> None:
    """The write reads a cache that ``__init__`` held in another attribute (hunt 50's G1): vLLM binds the real
    caches after building the layer, so it holds the placeholder. Refused, and the semantic level, which binds
    the stand-in's caches after ``__init__`` as vLLM does, fails it."""
    pytest.importorskip("torch")
    from test_fp8_index import semantic

    from rewriter.verify import Status

    path = tmp_path / "model.py"
    refused_but_not_its_base(path, PATCHED, CAPTURED[case])
    assert "which __init__ binds to a cache the call passes" in cli_check(path)
    level = semantic(path)
    assert level.status is Status.FAILED and "fp8 run failed" in level.reason


def cli_check(path: Path) -> str:
    from conftest import cli

    proc = cli("check", str(path))
    return proc.stdout + proc.stderr


IDX_FP8 = '            idx_dtype = "fp8_e4m3"  # an fp8 index cache: x / 1, saturating\n'
# What the write does depends on which fp8 dtype the cache is (hunt 50's G2): the flag is true for each, and the
# proof runs one spelling. Each is refused.
SPELLED = {
    "the main write for one spelling": [],  # (made below: the call one level deeper)
    "e5m2 refused by an assert": [(MAIN_WRITE, '        assert not self.kv_cache_dtype.endswith("e5m2")\n' + MAIN_WRITE)],
    "the index dtype following the main one": [(IDX_FP8, "            idx_dtype = self.kv_cache_dtype\n")],
}


@pytest.mark.parametrize("case", sorted(SPELLED))
def test_a_write_that_tells_the_fp8_dtypes_apart_is_refused(tmp_path: Path, case: str) -> None:
    path = tmp_path / "model.py"
    edits = SPELLED[case]
    if case == "the main write for one spelling":  # the call's lines one level deeper
        call = PATCHED.split(MAIN_WRITE)[1].split("        )\n")[0] + "        )\n"
        edits = [(MAIN_WRITE + call, '        if self.kv_cache_dtype == "fp8":\n' + "".join(
            "    " + line for line in (MAIN_WRITE + call).splitlines(keepends=True)))]
    refused_but_not_its_base(path, PATCHED, edits)
    assert "depends on which fp8 dtype the cache is" in cli_check(path)


# The same for every fp8 dtype: a test that reads the dtype but holds one value for each is no spelling.
@pytest.mark.parametrize("test", ['"fp8" in self.kv_cache_dtype', "self._fp8_kv"])
def test_a_test_alike_for_every_fp8_dtype_is_no_spelling(tmp_path: Path, test: str) -> None:
    path = tmp_path / "model.py"
    path.write_text(_edited(PATCHED, [(MAIN_WRITE, f"        assert {test}\n" + MAIN_WRITE)]))
    assert _states(path)[-1] == "patched"


def test_a_write_that_branches_on_the_batch_size_is_refused(tmp_path: Path) -> None:
    """A path the write takes for large batches alone (hunt 50's G5): the proof runs one batch, so it is refused;
    an ``assert`` on the sizes fails loudly, and is no other path."""
    path = tmp_path / "model.py"
    big = "        n = key.shape[0]\n        if n > 2048:\n            pass\n"
    refused_but_not_its_base(path, PATCHED, [(MAIN_WRITE, big + MAIN_WRITE)])
    assert "takes another path for some batch sizes" in cli_check(path)
    path.write_text(_edited(PATCHED, [(MAIN_WRITE, "        assert key.shape[0] == main_slot_mapping.shape[0]\n" + MAIN_WRITE)]))
    assert _states(path)[-1] == "patched"


def test_a_module_alias_of_the_op_namespace_names_the_write(tmp_path: Path) -> None:
    """``ops = torch.ops._C`` at module level binds ``ops`` for every method: the write goes to its cache ops."""
    from conftest import cli

    path = tmp_path / "model.py"
    alias = "import vllm._C  # noqa: F401\n\nops = torch.ops._C\n"
    path.write_text(_edited(FORK_ERA, [("from vllm import _custom_ops as ops\n", alias)]))
    assert cli("run", "--no-prove", str(path)).returncode == 0
    assert "torch.ops._C_cache_ops.reshape_and_cache_flash(" in path.read_text().split("def _insert_kv(")[1]


def test_a_cache_read_in_a_layout_of_its_own_is_the_stand_ins_limit(tmp_path: Path) -> None:
    """A native file whose common path reads the cache in a platform's layout (a real AMD fork's AITER path: four
    dims): the reference (bf16) run fails on the stand-in's NVIDIA-layout cache, which is the stand-in's limit, not
    the file's failure: skipped, never failed; the same line reading another tensor still fails it."""
    pytest.importorskip("torch")
    from test_fp8_index import semantic

    from rewriter.verify import Status

    path = tmp_path / "model.py"
    first = "        qkv, _ = self.qkv_proj(hidden_states)\n"
    path.write_text(NATIVE.replace(first, first + "        blocks, _, size, _ = self.kv_cache.shape\n"))
    level = semantic(path)
    assert level.status is Status.SKIPPED and "in a layout of its own" in level.reason
    path.write_text(NATIVE.replace(first, first + "        blocks, _, size, _ = qkv.shape\n"))
    assert semantic(path).status is Status.FAILED


def test_a_write_of_the_files_own_after_the_call_is_refused(tmp_path: Path) -> None:
    """The post-call handed to a registered op that finds the layer (hunt 50's h31): no method of the layer's, so
    not the bypass's post-call; ``run`` once added its own beside it (two writes). Refused, naming it."""
    path = tmp_path / "model.py"
    post = "            self._insert_kv(k, v, index_k, main_slot_mapping, index_slot_mapping)\n"
    op = "            torch.ops.vllm.mm3_fp8_kv_insert(k, v, index_k, main_slot_mapping, index_slot_mapping, self.layer_name)\n"
    refused_but_not_its_base(path, PATCHED, [(post, op)])
    assert "`torch.ops.vllm.mm3_fp8_kv_insert(…)` is handed the call's slot mappings" in cli_check(path)


@pytest.mark.parametrize("device", ['"cpu"', 'torch.device("cpu")'])
def test_a_scale_made_on_the_host_is_refused(tmp_path: Path, device: str) -> None:
    """A scale made at run time on the host (hunt 50's h75): the kernel reads it through a device pointer."""
    scale = "        scale = self._fp8_kv_scale  # identity: stores x / 1\n"
    made = f"        scale = torch.ones((), dtype=torch.float32, device={device})\n"
    refused_but_not_its_base(tmp_path / "model.py", PATCHED, [(scale, made)])
    path = tmp_path / "model.py"
    path.write_text(_edited(PATCHED, [(scale, made.replace(device, "key.device"))]))
    assert _states(path)[-1] == "patched"


def test_a_compiled_write_that_fails_on_the_stand_ins_cache_still_fails(tmp_path: Path) -> None:
    """The compiled path runs the bypass's write with a bf16 cache too: a failure there reading the stand-in's cache
    (the caches swapped, hunt 50's h40) is the file's, not a layout the stand-in lacks. Refused."""
    from test_hunt47 import COMPILED

    caches = "            layer.kv_cache,\n            layer.indexer.index_cache.kv_cache,\n"
    swapped = "            layer.indexer.index_cache.kv_cache,\n            layer.kv_cache,\n"
    refused_but_not_its_base(tmp_path / "model.py", COMPILED, [(caches, swapped)])
