"""Bad input gets a clear one-line error with file:line where there is one, and exit code 2."""
import textwrap

from datamove.cli import main

GOOD_HEADER = '''
import numpy as np
from dataflow.spec import Dropout, Tensor, dims
B, L, N = dims(B=2, L=3, N=4)
INDEX = {"b": B, "l": L, "n": N, "m": N}
'''

SCALE_LAYER = '''
def layer(x: Tensor("bln")):
    return x * np.float32(2)
'''  # a valid layer: the errors below come from the dims


def _run(tmp_path, capsys, body, *args, header=GOOD_HEADER):
    path = tmp_path / "spec.py"
    path.write_text(textwrap.dedent(header) + textwrap.dedent(body))
    code = main([str(path), "--analyze", *args])
    err = capsys.readouterr().err
    assert code == 2
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return path, err


def test_good_minimal_spec_runs(tmp_path, capsys):
    path = tmp_path / "ok.py"
    path.write_text(GOOD_HEADER + textwrap.dedent('''
        def layer(x: Tensor("bln"), w: Tensor("mn")):
            return np.einsum("bln,mn->blm", x, w)
        '''))
    assert main([str(path), "--analyze"]) == 0


def test_syntax_error_names_file_and_line(tmp_path, capsys):
    path, err = _run(tmp_path, capsys, '''
        def layer(x: Tensor("bln")):
            return x +* 2
        ''')
    assert f"{path}:8:" in err and "syntax error" in err


def test_np_var_named_with_hint(tmp_path, capsys):
    path, err = _run(tmp_path, capsys, '''
        def layer(x: Tensor("bln")):
            return np.var(x, axis=2)
        ''')
    assert f"{path}:8:" in err and "np.var" in err and "np.sum" in err


def test_keepdims_named_with_hint(tmp_path, capsys):
    _, err = _run(tmp_path, capsys, '''
        def layer(x: Tensor("bln")):
            return x - np.max(x, axis=2, keepdims=True)
        ''')
    assert "keepdims" in err and "None" in err


def test_missing_dims_listed(tmp_path, capsys):
    header = GOOD_HEADER.replace("B, L, N = dims(B=2, L=3, N=4)", "B, L, N = dims(B=None, L=None, N=4)")
    _, err = _run(tmp_path, capsys, SCALE_LAYER, header=header)
    assert "missing dims: B, L" in err


def test_non_positive_dims_listed(tmp_path, capsys):
    _, err = _run(tmp_path, capsys, SCALE_LAYER, "--dims", "B=0,L=-3")
    assert "positive" in err and "B=0" in err and "L=-3" in err


def test_contradictory_dims_on_command_line(tmp_path, capsys):
    _, err = _run(tmp_path, capsys, SCALE_LAYER, "--dims", "B=2,B=3")
    assert "contradictory" in err and "B" in err


def test_contradictory_letter_sizes(tmp_path, capsys):
    _, err = _run(tmp_path, capsys, '''
        def layer(x: Tensor("bln"), w: Tensor("mn")):
            return np.einsum("blb,mn->blm", x, w)
        ''')
    assert "contradictory dims" in err and "letter b" in err


def test_unknown_dim_on_command_line(tmp_path, capsys):
    _, err = _run(tmp_path, capsys, SCALE_LAYER, "--dims", "Q=2")
    assert "unknown dims Q" in err


def test_file_without_layer_function(tmp_path, capsys):
    _, err = _run(tmp_path, capsys, '''
        def helper(x):
            return x
        ''')
    assert "no layer function" in err and "Tensor(" in err
