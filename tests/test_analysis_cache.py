"""The analysis kept on disk (``datamove.dataflow.analysis_cache``): a re-run reads back what a fresh
analysis gives, and any change it depends on (the spec, a module it imports, its dims or options),
a damaged entry or an unwritable folder makes it analyse again."""
import shutil
from unittest import mock

import pytest

from datamove.dataflow import analysis_cache
from datamove.dataflow.pipeline import analyse_spec
from datamove.dataflow.snapshot import snapshot_fused

SPEC = "tests/specs_plain/mlp_softmax.py"


def _same(a, b) -> None:
    assert a.json == b.json
    assert snapshot_fused(a) == snapshot_fused(b)
    assert a.spec.dim_values == b.spec.dim_values and a.spec.inputs == b.spec.inputs


def _no_analysis():
    return mock.patch.object(analysis_cache, "analyse_loaded", side_effect=AssertionError("analysed again"))


def test_a_rerun_reads_back_the_analysis_a_fresh_run_gives(tmp_path):
    first = analysis_cache.cached_analysis(SPEC, {}, {}, folder=tmp_path)
    assert len(list(tmp_path.glob("*.pkl"))) == 1
    with _no_analysis():
        again = analysis_cache.cached_analysis(SPEC, {}, {}, folder=tmp_path)
    _same(again, analyse_spec(SPEC))
    _same(again, first)
    assert again.spec.function is not first.spec.function  # the spec itself loaded anew


def test_other_dims_options_or_sources_are_another_entry(tmp_path):
    spec = tmp_path / "layer.py"
    shutil.copy("tests/specs_plain/gelu_mlp.py", spec)
    folder = tmp_path / "cache"
    analysis_cache.cached_analysis(spec, {}, {}, folder=folder)
    small = analysis_cache.cached_analysis(spec, {"B": 4}, {}, folder=folder)
    assert small.spec.dim_values["B"] == 4 and len(list(folder.glob("*.pkl"))) == 2
    spec.write_text(spec.read_text() + "\n# edited\n")
    analysis_cache.cached_analysis(spec, {}, {}, folder=folder)
    assert len(list(folder.glob("*.pkl"))) == 3
    with mock.patch.object(analysis_cache, "sources_digest", return_value="another datamove"):
        analysis_cache.cached_analysis(spec, {}, {}, folder=folder)
    assert len(list(folder.glob("*.pkl"))) == 4


def test_a_local_module_the_spec_imports_is_part_of_the_key(tmp_path, monkeypatch):
    helper = tmp_path / "helpers_for_cache.py"
    helper.write_text("SCALE = 0.5\n")
    spec = tmp_path / "layer.py"
    spec.write_text("import numpy as np\n\nimport helpers_for_cache\nfrom datamove.dataflow.spec import Tensor, dims\n"
                    "from helpers_for_cache import SCALE\n\nN, M, K = dims(N=5, M=3, K=4)\nINDEX = {'n': N, 'm': M, 'k': K}\n\n\n"
                    "def layer(x: Tensor('nm'), w: Tensor('mk')):\n    return np.tanh(x @ w) * SCALE\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    analysis_cache.cached_analysis(spec, {}, {}, folder=tmp_path / "cache")
    loaded = analysis_cache.loaded_spec(spec)
    assert analysis_cache.local_modules(loaded) == {helper.resolve()}
    before = analysis_cache.analysis_key(loaded)
    helper.write_text("SCALE = 0.5  # the same value\n")
    assert analysis_cache.analysis_key(loaded) != before
    monkeypatch.delitem(__import__("sys").modules, "helpers_for_cache")
    helper.write_text("SCALE = 0.25\n")
    assert analysis_cache.analysis_key(analysis_cache.loaded_spec(spec)) not in (before, analysis_cache.analysis_key(loaded))


@pytest.mark.parametrize("damage", [b"", b"not a pickle", b"\x80\x05K"])
def test_a_damaged_entry_is_analysed_again_and_rewritten(tmp_path, damage):
    analysis_cache.cached_analysis(SPEC, {}, {}, folder=tmp_path)
    (entry,) = tmp_path.glob("*.pkl")
    entry.write_bytes(damage)
    _same(analysis_cache.cached_analysis(SPEC, {}, {}, folder=tmp_path), analyse_spec(SPEC))
    with _no_analysis():
        analysis_cache.cached_analysis(SPEC, {}, {}, folder=tmp_path)


def test_an_unwritable_folder_only_means_no_cache(tmp_path):
    blocked = tmp_path / "a file"
    blocked.write_text("")
    _same(analysis_cache.cached_analysis(SPEC, {}, {}, folder=blocked / "cache"), analyse_spec(SPEC))


def test_a_local_module_that_cannot_be_read_means_no_cache(tmp_path):
    with mock.patch.object(analysis_cache, "analysis_key", side_effect=FileNotFoundError("gone")):
        _same(analysis_cache.cached_analysis(SPEC, {}, {}, folder=tmp_path), analyse_spec(SPEC))
    assert not list(tmp_path.iterdir())
