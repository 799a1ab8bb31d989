"""``optimize-layer``'s output folder is written whole or not at all (``datamove.output``).

One run's artifact and report go into a temporary sibling folder that replaces the output folder
at the end: an interrupted run leaves the previous output whole and loadable and no temporary
folder behind; a rerun leaves nothing of the previous run (no stale kernel file); the manifest and
``report.json`` carry the plan's identity and the ``--set`` options.  CPU (cost model) runs.
"""
import json
import os
import warnings
from pathlib import Path

import pytest
import torch

import datamove.output as output
from datamove.cli import main
from datamove.export import ArtifactError, load_layer
from datamove.job import default_out
from datamove.output import OutputError, check_out, whole_folder

REPO = Path(__file__).resolve().parents[1]
BERT = str(REPO / "configs" / "bert.py")
SMALL = "B=2,L=64,N=64,H=2,P=32,U=128"

on_cpu = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU job (cost model); a GPU would tune")


def load(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_layer(path, device="cpu", dtype=torch.float32, allow_mismatch=True)


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    """A job's output (relu) and its files."""
    out = tmp_path_factory.mktemp("job") / "bert"
    assert main([BERT, "--dims", SMALL, "--out", str(out)]) == 0
    return out, snapshot(out)


@on_cpu
def test_the_manifest_and_report_carry_the_plan_identity_and_options(first):
    out, _ = first
    manifest = json.loads((out / "manifest.json").read_text())
    report = json.loads((out / "report.json").read_text())
    assert manifest["options"] == {} and report["meta"]["options"] == {}
    assert len(manifest["plan_id"]) == 16 and report["meta"]["plan_id"] == manifest["plan_id"]
    assert [p.name for p in out.parent.iterdir()] == ["bert"]  # no temporary folder beside it


@on_cpu
@pytest.mark.parametrize("stage", ["report", "export"])
def test_an_interrupted_run_leaves_the_previous_output_whole(first, tmp_path, capsys, monkeypatch, stage):
    out = tmp_path / "bert"
    for name, content in first[1].items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(content)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("datamove.report.write_report" if stage == "report" else "datamove.export.write_artifact",
                        interrupted)
    assert main([BERT, "--dims", SMALL, "--set", "activation=gelu", "--out", str(out)]) == 130
    captured = capsys.readouterr()
    assert captured.err == "optimize-layer: interrupted\n" and "Traceback" not in captured.out
    assert snapshot(out) == first[1]
    assert [p.name for p in tmp_path.iterdir()] == ["bert"]
    assert load(out) is not None


@on_cpu
def test_a_rerun_replaces_everything_and_records_its_options(first, tmp_path, capsys):
    out = tmp_path / "bert"
    for name, content in first[1].items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(content)
    (out / "kernels" / "d_b1_of_another_run.py").write_text("stale\n")
    assert main([BERT, "--dims", SMALL, "--set", "activation=gelu", "--out", str(out), "--db",
                 str(tmp_path / "t.db")]) == 0
    printed = capsys.readouterr().out
    assert "\nNo CUDA GPU found: NOTHING IS MEASURED. The selection runs on the cost model" in printed
    assert "Not used without a GPU (nothing is measured): --db " in printed
    assert not (out / "kernels" / "d_b1_of_another_run.py").exists() and not (tmp_path / "t.db").exists()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["options"] == {"activation": "gelu"}
    assert manifest["plan_id"] != json.loads(first[1]["manifest.json"])["plan_id"]
    assert json.loads((out / "report.json").read_text())["meta"]["plan_id"] == manifest["plan_id"]
    assert [p.name for p in tmp_path.iterdir()] == ["bert"]
    assert load(out) is not None


@on_cpu
def test_a_folder_mixing_two_runs_is_refused(first, tmp_path):
    """The report of one run beside the artifact of another (what an interrupted run left before
    outputs were written whole), and a plan.json that is not the manifest's."""
    out = tmp_path / "bert"
    for name, content in first[1].items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(content)
    report = json.loads((out / "report.json").read_text())
    (out / "report.json").write_text(json.dumps({**report, "meta": {**report["meta"], "plan_id": "0123456789abcdef"}}))
    with pytest.raises(ArtifactError) as raised:
        load(out)
    message = str(raised.value)
    assert message.startswith(f"{out}: report.json is of another plan (0123456789abcdef)") and \
        message.endswith("write the artifact again with optimize-layer SPEC --out DIR") and "\n" not in message


def test_the_default_folder_names_the_set_options():
    shapes = [{"B": 8, "L": 512}]
    assert default_out("bert", shapes, "bfloat16", "costmodel", {"activation": "gelu"}) == \
        Path("out/bert-activation_gelu-B8-L512-bf16-costmodel")
    assert default_out("bert", shapes, "bfloat16", "costmodel") == Path("out/bert-B8-L512-bf16-costmodel")
    assert default_out("x", shapes, "float16", "NVIDIA H100", {"p": "0.1", "k": "a/b"}) == \
        Path("out/x-p_0.1-k_a_b-B8-L512-fp16-nvidia-h100")


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_whole_folder_replaces_or_leaves_as_it_was(tmp_path, monkeypatch, exchange):
    if not exchange:
        monkeypatch.setattr(output, "_exchange", lambda a, b: False)
    out = tmp_path / "out"
    with whole_folder(out) as folder:
        (folder / "a").write_text("1")
    assert snapshot(out) == {"a": b"1"}
    with whole_folder(out) as folder:
        (folder / "b").write_text("2")
    assert snapshot(out) == {"b": b"2"}
    for error in (KeyboardInterrupt, RuntimeError):
        with pytest.raises(error):
            with whole_folder(out) as folder:
                (folder / "c").write_text("3")
                raise error
        assert snapshot(out) == {"b": b"2"}
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_leftovers_of_a_killed_run_are_cleared(tmp_path):
    dead = 2 ** 22 + 12345  # above Linux's default pid_max: no such process
    out = tmp_path / "out"
    (tmp_path / f"out.tmp-{dead}").mkdir()
    (tmp_path / f"out.old-{dead}").mkdir()
    (tmp_path / f"out.old-{dead}" / "manifest.json").write_text("{}")  # renamed aside, nothing in its place
    (tmp_path / f"other.tmp-{dead}").mkdir()
    with whole_folder(out) as folder:
        assert (out / "manifest.json").is_file()  # the old output is back in place while the new one is written
        (folder / "manifest.json").write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.tmp-" + str(dead), "out"]
    assert (out / "manifest.json").read_text() == "new"


def test_check_out_accepts_a_new_or_empty_folder_or_an_earlier_output(tmp_path):
    check_out(tmp_path / "new" / "deeper")
    (tmp_path / "empty").mkdir()
    check_out(tmp_path / "empty")
    (tmp_path / "earlier").mkdir()
    (tmp_path / "earlier" / "manifest.json").write_text("{}")
    check_out(tmp_path / "earlier")
    with pytest.raises(OutputError, match="an existing folder that is not an output of optimize-layer"):
        check_out(tmp_path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_check_out_refuses_a_read_only_folder(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(OutputError, match="cannot be written"):
            check_out(locked / "out")
    finally:
        locked.chmod(0o700)
