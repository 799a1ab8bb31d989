"""Every bad input of ``optimize-layer`` ends in one line (``optimize-layer: error: ...``, exit
status 2), Ctrl-C in ``optimize-layer: interrupted`` (130), never in a traceback; the options
are checked before the analysis starts (here the analysis and the job are replaced by stand-ins
that fail the test if reached)."""
import subprocess
import sys
from pathlib import Path

import pytest

from datamove.cli import main

REPO = Path(__file__).resolve().parents[1]
BERT = str(REPO / "configs" / "bert.py")


@pytest.fixture
def no_long_stages(monkeypatch):
    def reached(*args, **kwargs):
        raise AssertionError("the analysis started before the options were checked")

    monkeypatch.setattr("datamove.job.run_job", reached)
    monkeypatch.setattr("datamove.cli._analyze", reached)
    monkeypatch.setattr("datamove.dataflow.pipeline.analyse_spec", reached)


def one_line_error(capsys) -> str:
    captured = capsys.readouterr()
    err = captured.err
    assert "Traceback" not in err + captured.out, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("optimize-layer: error: "), err
    return err.strip()


def cases(tmp_path: Path) -> dict:
    """{case: (arguments, what the line says)}."""
    a_file = tmp_path / "notes.txt"
    a_file.write_text("not a folder\n")
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "thesis.tex").write_text("mine\n")
    return {
        "--out an existing file": (["--out", str(a_file)], f"--out {a_file}: an existing file, not a folder"),
        "--out under a file": (["--out", str(a_file / "sub")], f"--out {a_file / 'sub'}: {a_file} is a file"),
        "--out a folder of other files": (["--out", str(folder)],
                                          f"--out {folder}: an existing folder that is not an output of optimize-layer"),
        "--cost-model-device A100": (["--cost-model-device", "A100"],
                                     "--cost-model-device A100: no cost-model figures for this device; known: H100, H200"),
        "--gpus 0": (["--gpus", "0"], "argument --gpus: '0': expected a positive number of GPUs"),
        "--gpus two": (["--gpus", "two"], "argument --gpus: 'two': expected a positive number of GPUs"),
        "--budget-s -1": (["--budget-s", "-1"], "argument --budget-s: '-1': expected a number of seconds >= 0"),
        "--dtype fp32": (["--dtype", "fp32"], "argument --dtype: invalid choice: 'fp32'"),
        "an unknown option": (["--bogus"], "unrecognized arguments: --bogus (optimize-layer --help lists the options)"),
        "--db a folder": (["--db", str(tmp_path)], f"--db {tmp_path}: a folder: name a file"),
        "--db under a file": (["--db", str(a_file / "t.db")], f"--db {a_file / 't.db'}: {a_file} is a file"),
        "--json without --analyze": (["--json", str(tmp_path / "a.json")], "only with --analyze"),
        "--dims not a number": (["--dims", "B=x"], "--dims: B=x: expected an integer"),
        "--set not NAME=VALUE": (["--set", "gelu"], "--set: expected NAME=VALUE"),
        "--dims twice": (["--dims", "B=3", "--dims", "L=5"],  # argparse kept the last: B ran at the spec's size
                         "--dims given twice: give all its values in one, e.g. --dims B=3,L=5"),
        "--set twice": (["--set", "activation=gelu", "--set", "activation=relu"], "--set given twice"),
        "--dims past int64": (["--dims", "B=99999999999999999999"],  # a torch overflow dump after the analysis
                              "--dims: B=99999999999999999999: a dim must be at most 2147483647"),
    }


CASES = ["--out an existing file", "--out under a file", "--out a folder of other files", "--cost-model-device A100",
         "--gpus 0", "--gpus two", "--budget-s -1", "--dtype fp32", "an unknown option", "--db a folder",
         "--db under a file", "--json without --analyze", "--dims not a number", "--set not NAME=VALUE",
         "--dims twice", "--set twice", "--dims past int64"]


@pytest.mark.parametrize("case", CASES)
def test_a_bad_option_is_one_line_before_the_analysis(tmp_path, capsys, no_long_stages, case):
    arguments, says = cases(tmp_path)[case]
    assert main([BERT, *arguments]) == 2
    assert says in one_line_error(capsys)


def test_more_gpus_than_the_host_has_is_one_line(tmp_path, capsys, no_long_stages, monkeypatch):
    """``--gpus 4`` on a host of two H200s (the device query stood in for): refused before the analysis."""
    import dataclasses

    from datamove.kernels import device

    fields = {f.name: 1 for f in dataclasses.fields(device.DeviceFacts)}
    facts = device.DeviceFacts(**{**fields, "index": 0, "name": "NVIDIA H200", "compute_capability": (9, 0)})
    monkeypatch.setattr(device, "query_device", lambda index=0: facts)
    monkeypatch.setattr("datamove.harness.bench.gpu_ids", lambda name: ["0", "1"])
    assert main([BERT, "--gpus", "4", "--out", str(tmp_path / "bert")]) == 2
    assert "--gpus 4: this host has 2 NVIDIA H200 GPU(s) to measure on; give at most 2" in one_line_error(capsys)


def test_an_analysis_json_under_a_file_is_one_line(tmp_path, capsys, no_long_stages):
    (tmp_path / "f").write_text("")
    assert main([BERT, "--analyze", "--json", str(tmp_path / "f" / "a.json")]) == 2
    assert f"--json {tmp_path / 'f' / 'a.json'}: {tmp_path / 'f'} is a file" in one_line_error(capsys)


@pytest.mark.parametrize("spec, says", [("nowhere.py", "nowhere.py: no such spec file"),
                                        ("configs", "configs: a folder, not a spec file")])
def test_a_spec_that_is_not_a_file_is_one_line(capsys, no_long_stages, spec, says):
    assert main([str(REPO / spec)]) == 2
    assert says in one_line_error(capsys)


def test_a_missing_spec_argument_is_one_line(capsys):
    assert main([]) == 2
    assert "the following arguments are required: spec" in one_line_error(capsys)


def test_the_default_output_folder_is_checked_before_the_analysis(tmp_path, capsys, no_long_stages, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("out").write_text("a file where the default output folders go\n")
    assert main([BERT]) == 2
    assert "out: an existing file where the default output folder out/<spec>-... would go: pass --out DIR" in \
        one_line_error(capsys)


def test_ctrl_c_during_the_analysis_is_one_line_and_130(tmp_path, capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("datamove.dataflow.analysis_cache.cached_analysis", interrupted)
    out = tmp_path / "bert"
    assert main([BERT, "--out", str(out)]) == 130
    captured = capsys.readouterr()
    assert captured.err == "optimize-layer: interrupted\n" and "Traceback" not in captured.out
    assert list(tmp_path.iterdir()) == []  # nothing written


# Ctrl-C while DaCe is being imported: a finder raising KeyboardInterrupt on its import, ahead of
# ``python -m datamove.cli`` (the module imported DaCe at its top, before main's handler: a traceback)
INTERRUPTED_IMPORT = """
import runpy, sys

class Interrupt:
    def find_spec(self, name, path=None, target=None):
        if name == "dace":
            raise KeyboardInterrupt

sys.meta_path.insert(0, Interrupt())
sys.argv = ["optimize-layer", sys.argv[1], "--analyze"]
runpy.run_module("datamove.cli", run_name="__main__", alter_sys=True)
"""


def test_ctrl_c_while_the_modules_load_is_one_line_and_130():
    run = subprocess.run([sys.executable, "-c", INTERRUPTED_IMPORT, BERT], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert (run.returncode, run.stderr, run.stdout) == (130, "optimize-layer: interrupted\n", ""), run.stderr


@pytest.mark.parametrize("content, says", [
    (None, "no such file"),
    (b"\x00\x9f binary", "not valid JSON"),
    (b'{"meta": {}', "not valid JSON"),
    (b"[1, 2]", "not a datamove report.json"),
    (b'{"meta": {}, "ceilings": {}, "chosen": [{"name": 1}], "pytorch": [], "movement": {}}',
     "not a datamove report.json (TypeError"),
])
def test_regenerating_a_damaged_report_is_one_line(tmp_path, capsys, content, says):
    from datamove.report import main as report_main

    path = tmp_path / "report.json"
    if content is not None:
        path.write_bytes(content)
    assert report_main([str(path)]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert "Traceback" not in captured.err and len(err.splitlines()) == 1, err
    assert err.startswith(f"datamove.report: error: {path}: ") and says in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == (["report.json"] if content is not None else [])


def test_python_m_datamove_report_exits_2_on_a_damaged_file(tmp_path):
    path = tmp_path / "report.json"
    path.write_text('{"chosen": ')
    run = subprocess.run([sys.executable, "-m", "datamove.report", str(path)], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.startswith(f"datamove.report: error: {path}: not valid JSON"), run.stderr
    assert path.read_text() == '{"chosen": '
