"""Bad input gets a clear one-line error with file:line where there is one, and exit code 2."""
import re
import textwrap
from pathlib import Path

import pytest

from datamove.dataflow.spec import SpecError, load_spec
from datamove.cli import main

GOOD_HEADER = '''
import numpy as np
from datamove.dataflow.spec import Dropout, Tensor, dims
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


INPUTS_LAYER = '''
def layer(x: Tensor("bln"), w: Tensor("mn"), mask: Tensor("bl", requires_grad=False), drop: Dropout("blm", 0.1)):
    return np.einsum("bln,mn->blm", x, w) * mask[:, :, None] * drop
'''


@pytest.mark.parametrize("inputs, problem", [
    ('("x", "memory")', "INPUTS names 'memory', which layer does not have; its arguments are x, w, mask, drop"),
    ('"x"', "INPUTS = 'x': expected a tuple of the argument names the layer is called with, e.g. INPUTS = (\"x\",)"),
    ("()", "INPUTS = (): expected a tuple"),
    ('("drop",)', "INPUTS names 'drop', a Dropout mask: datamove draws masks itself"),
    ('("x", "mask")', "INPUTS names 'mask', declared Tensor('bl', requires_grad=False)"),
    ('("x", "x")', "INPUTS names 'x' twice"),
])
def test_inputs_that_contradict_the_layer_are_refused(tmp_path, capsys, inputs, problem):
    path, err = _run(tmp_path, capsys, f"\nINPUTS = {inputs}\n" + INPUTS_LAYER)
    assert f"{path}:7: {problem}" in err, err


def test_declared_inputs_are_read(tmp_path):
    path = tmp_path / "spec.py"
    path.write_text(textwrap.dedent(GOOD_HEADER) + '\nINPUTS = ["w", "x"]\n' + INPUTS_LAYER)
    assert load_spec(path).inputs == ("w", "x")
    path.write_text(textwrap.dedent(GOOD_HEADER) + INPUTS_LAYER)
    assert load_spec(path).inputs is None


def test_plain_numpy_is_accepted(tmp_path, capsys):
    """What used to be refused here: np.var, keepdims, @, Python floats."""
    path = tmp_path / "ok.py"
    path.write_text(GOOD_HEADER + textwrap.dedent('''
        def layer(x: Tensor("bln"), w: Tensor("nm")):
            v = np.var(x, axis=-1, keepdims=True)
            return (x - np.max(x, axis=2, keepdims=True)) / np.sqrt(v + 1e-5) @ w * 0.5
        '''))
    assert main([str(path), "--analyze"]) == 0


# The corpus of bad specs: layer -> (the construct as written, which the message must quote on
# its line; a fragment of the hint saying what to write instead).
REFUSED = {
    "reshape": ('''
        def layer(x: Tensor("bln"), w: Tensor("nm")):
            h = x @ w
            return h.reshape(2, 3, 2, 2)
        ''', "h.reshape(2, 3, 2, 2)", "own letter"),
    "slice": ('''
        def layer(x: Tensor("bln")):
            return x[:, 0] * 2.0
        ''', "x[:, 0]", "own Tensor argument"),
    "comparison": ('''
        def layer(x: Tensor("bln")):
            keep = x > 0.0
            return x * keep
        ''', "x > 0.0", "np.where"),
    "broadcast": ('''
        def layer(x: Tensor("bln"), c: Tensor("l")):
            return x + c
        ''', "x + c", "align them"),
    "matmul mismatch": ('''
        def layer(x: Tensor("bln")):
            y = x @ x
            return y
        ''', "x @ x", "transpose one"),
    "unsupported function": ('''
        def layer(x: Tensor("bln")):
            return np.sin(x)
        ''', "np.sin(x)", "np.tanh"),
    "condition on arrays": ('''
        def layer(x: Tensor("bln")):
            if np.sum(x, axis=2) > 0:
                x = -x
            return x
        ''', "np.sum(x, axis=2) > 0", "np.where"),
    "exponent": ('''
        def layer(x: Tensor("bln")):
            return x ** 1.7
        ''', "x ** 1.7", "np.exp(y * np.log(x))"),
    "transposed output": ('''
        def layer(x: Tensor("bln")):
            return np.exp(x).T
        ''', "np.exp(x).T", "order of its axes"),
    "einsum ellipsis": ('''
        def layer(x: Tensor("bln"), w: Tensor("mn")):
            return np.einsum("...n,mn->...m", x, w)
        ''', 'np.einsum("...n,mn->...m", x, w)', "letter"),
    "einsum output repeats a letter": ('''
        def layer(x: Tensor("bln"), w: Tensor("mn")):
            return np.einsum("bln,mn->bmm", x, w)
        ''', 'np.einsum("bln,mn->bmm", x, w)', "its own letter"),
    "einsum output letter of no operand": ('''
        def layer(x: Tensor("bln"), w: Tensor("mn")):
            return np.einsum("bln,mn->blk", x, w)
        ''', 'np.einsum("bln,mn->blk", x, w)', "only letters of the operands"),
    "full reduction": ('''
        def layer(x: Tensor("bln")):
            return x - x.mean()
        ''', "x.mean()", "axis="),
    "outer product": ('''
        def layer(x: Tensor("bln"), v: Tensor("n")):
            return x + v[:, None] * v[None, :]
        ''', "v[:, None] * v[None, :]", "np.einsum('s,t->st', a, b)"),
    "conditional expression": ('''
        def layer(x: Tensor("bln")):
            return x if 1 > 0 else -x
        ''', "x if 1 > 0 else -x", "np.where"),
    "float64": ('''
        def layer(x: Tensor("bln")):
            return x * np.float64(2.0)
        ''', "np.float64(2.0)", "np.float32"),
    "random": ('''
        def layer(x: Tensor("bln")):
            return x * np.random.rand(2, 3, 4)
        ''', "np.random.rand", "Dropout"),
    "slice with a step": ('''
        def layer(x: Tensor("bln")):
            return x[..., ::2] * 2.0
        ''', "x[..., ::2]", "contiguous parts"),
    "slice contracted": ('''
        def layer(x: Tensor("bln"), w: Tensor("mn")):
            return np.einsum("bln,mn->blm", x[..., :2], w)
        ''', "x[..., :2]", "put back together with np.concatenate"),
    "slices of different parts combined": ('''
        def layer(x: Tensor("bln")):
            return np.concatenate((x[..., :2] * x[..., 2:], x[..., 2:]), axis=-1)
        ''', "x[..., :2] * x[..., 2:]", "sliced the same way"),
    "concatenate growing an axis": ('''
        def layer(x: Tensor("bln")):
            return np.concatenate((x, x), axis=-1)
        ''', "np.concatenate((x, x), axis=-1)", "as rotate_half"),
    "slice out of range": ('''
        def layer(x: Tensor("bln")):
            return np.concatenate((x[..., :N + 1], x[..., N + 1:]), axis=-1)
        ''', "x[..., :N + 1]", "out of range"),
    "repeat to no dim": ('''
        def layer(x: Tensor("bln")):
            return np.repeat(x, 2, axis=1)
        ''', "np.repeat(x, 2, axis=1)", "H // KV"),
    "tril of a computed array": ('''
        def layer(x: Tensor("bln")):
            return np.tril(x)
        ''', "np.tril(x)", "np.tril(np.ones((T, T)))"),
    "einsum optimize=": ('''
        def layer(x: Tensor("bln"), w: Tensor("mn")):
            return np.einsum("bln,mn->blm", x, w, optimize=True)
        ''', "optimize=", "drop optimize="),  # DaCe's parse stopped at ImportError: ... install the "opt_einsum" package
    "output returned twice": ('''
        def layer(x: Tensor("bln")):
            y = np.tanh(x)
            return y, y
        ''', "return y, y", "return each output once"),  # DaCe's parse stopped at KeyError: 'y'
    "np.split unpacked": ('''
        def layer(x: Tensor("bln")):
            x1, x2 = np.split(x, 2, axis=-1)
            return x1 * x2
        ''', "np.split(x, 2, axis=-1)", "slice the axis into its parts"),
    "clip by an array": ('''
        def layer(x: Tensor("bln"), c: Tensor("n")):
            return np.clip(x, c, 1.0)
        ''', "np.clip(x, c, 1.0)", "np.minimum(np.maximum(x, lo), hi)"),
    "clip bounds swapped": ('''
        def layer(x: Tensor("bln")):
            return np.clip(x, 1.0, -1.0)
        ''', "np.clip(x, 1.0, -1.0)", "swap the bounds"),
    "clip without a bound": ('''
        def layer(x: Tensor("bln")):
            return x.clip(None, None)
        ''', "x.clip(None, None)", "give a lower or an upper bound"),
    "clip without its array": ('''
        def layer(x: Tensor("bln")):
            return x * np.clip(a_min=0.0, a_max=1.0)
        ''', "np.clip(a_min=0.0, a_max=1.0)", "np.clip without the array to clip; write np.clip(x, lo, hi)"),
    "clip given its array twice": ('''
        def layer(x: Tensor("bln")):
            return np.clip(x, a=x, a_max=1.0)
        ''', "np.clip(x, a=x, a_max=1.0)", "np.clip given its array twice"),
    "clip by a keyword it lacks": ('''
        def layer(x: Tensor("bln")):
            return np.clip(x, lower=-1.0)
        ''', "np.clip(x, lower=-1.0)", "(or a_min= / min= / a_max= / max=), a bound None where there is none"),
    "slice of a shape": ('''
        def layer(x: Tensor("bln")):
            return x + np.triu(np.full(x.shape[-2:], -1e4), k=1)
        ''', "x.shape[-2:]", "name each size"),  # it said "-2:: Slice expressions are not supported"
}
INTERNAL = re.compile(r"__\w+|\btmp\d|\w+_(plus|times|minus|div)_\w+|einsum_\w+|\bexpr\b")  # DaCe's temporaries


@pytest.mark.parametrize("case", REFUSED)
def test_refused_construct_names_line_and_hint(tmp_path, capsys, case):
    body, construct, hint = REFUSED[case]
    path, err = _run(tmp_path, capsys, body)
    line = next(n for n, text in enumerate(path.read_text().splitlines(), 1) if construct in text)
    assert f"{path}:{line}: " in err and construct in err and hint in err, err
    assert not INTERNAL.search(err), err


def test_a_letter_of_size_1_does_not_broadcast(tmp_path, capsys):
    """A letter whose dim is 1 meeting another letter on one axis (NumPy would broadcast it): refused in
    one line saying why (the graph's axes are letters, sized by their dims, which a call or --dims may
    change) and how to write it (that operand without the axis, indexed with None)."""
    header = GOOD_HEADER.replace("dims(B=2, L=3, N=4)", "dims(B=2, L=3, N=4, O=1)").replace('"m": N}', '"m": N, "o": O}')
    header = header.replace("B, L, N =", "B, L, N, O =")
    path, err = _run(tmp_path, capsys, '''
        def layer(x: Tensor("bln"), s: Tensor("bo")):
            return x * s[:, :, None]
        ''', header=header)
    assert f"{path}:8: x * s[:, :, None]: cannot broadcast: axis -2 is l (L) in one operand and o (O = 1) in another; " \
        "a letter of size 1 is an axis of its dim (O may take another size), it does not broadcast; declare s " \
        'without it, Tensor("b"), and index it with None where it broadcasts: s[:, None, None]' in err, err


def test_index_letter_over_an_expression_of_dims_is_named(tmp_path, capsys):
    """A letter over N // 2 (half-size RoPE tables) cannot be given with --dims: the refusal says to
    declare a dim of its own (it said "missing dims: floor(N/2) (give them with --dims ...)")."""
    header = GOOD_HEADER.replace('"m": N}', '"m": N // 2}')
    _, err = _run(tmp_path, capsys, SCALE_LAYER, header=header)
    assert "INDEX letter 'm' maps to floor(N/2), not a dim" in err and "M in dims(M=...)" in err, err


def test_a_negated_size_is_a_size(tmp_path, capsys):
    """np.triu(.., -(L - 1)): unary minus on a parenthesised size keeps it a size (it was refused)."""
    path = tmp_path / "ok.py"
    path.write_text(GOOD_HEADER + textwrap.dedent('''
        def layer(x: Tensor("bln"), w: Tensor("mn")):
            window = np.triu(np.ones((L, L)), -(L - 2))
            return np.einsum("bln,mn->blm", x, w) + np.einsum("lk,bkn->bln", window, x)
        '''))
    assert main([str(path), "--analyze"]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("body, says", [
    ('''
        def layer(x: Tensor("bln"), w: Tensor("mn"), c: Tensor("m")):
            return np.einsum("bln,mn->blm", x, w)
        ''', "layer does not use its argument c: remove it from the signature, or use it in the layer"),
    ('''
        OPTIONS = {"bias": ("no", "yes")}
        BIAS = "no"


        def layer(x: Tensor("bln"), w: Tensor("mn"), c: Tensor("m"), d: Tensor("m")):
            y = np.einsum("bln,mn->blm", x, w)
            if BIAS == "yes":
                y = y + c + d
            return y
        ''', "layer does not use its arguments c, d with bias=no: remove them"),
])
def test_an_argument_the_layer_does_not_read_is_named_with_the_def_line(tmp_path, capsys, body, says):
    """A weight the forward never reads (one used under another OPTIONS value) has no gradient to
    compute: refused naming it and the def line (the export stopped at "the training graph has no
    gradient tensor 'd_c'", with neither)."""
    path, err = _run(tmp_path, capsys, body)
    line = next(n for n, text in enumerate(path.read_text().splitlines(), 1) if text.startswith("def layer"))
    assert f"{path}:{line}: {says}" in err, err


@pytest.mark.parametrize("use", ["np.where(c > 0.0, x, -x)", "x + c * 0"])
def test_an_argument_whose_gradient_is_zero_is_named_with_the_def_line(tmp_path, capsys, use):
    """A weight read only in np.where's condition (a mask not declared a constant), or times 0, has a
    gradient of 0 that autodiff does not derive: refused naming it (the export stopped at "the
    training graph has no gradient tensor 'd_c'"); declared a constant, it runs."""
    path, err = _run(tmp_path, capsys, f'''
        def layer(x: Tensor("bln"), c: Tensor("n")):
            return {use}
        ''')
    assert f"{path}:7: argument c has no gradient: layer reads it only where its gradient is 0" in err, err
    assert "declare it Tensor('n', requires_grad=False), a constant" in err, err
    path.write_text(path.read_text().replace('c: Tensor("n")', 'c: Tensor("n", requires_grad=False)'))
    assert main([str(path), "--analyze"]) == 0, capsys.readouterr().err

def test_an_argument_without_letters_is_named(tmp_path, capsys):
    """Tensor("") (a learned scalar, ReZero's alpha): DaCe's parse stopped at "'NoneType' object has
    no attribute 'num_elements'"; now one line naming the argument and what to declare."""
    _, err = _run(tmp_path, capsys, '''
        def layer(x: Tensor("bln"), alpha: Tensor("")):
            return x + alpha * np.tanh(x)
        ''')
    assert "argument alpha: Tensor('') names no axis; every argument has at least one letter" in err, err

@pytest.mark.parametrize("line, says", [
    ('TORCH_ORDER = ["x"]', "TORCH_ORDER = ['x']: expected a dict of data inputs and outputs to their letters"),
    ('TORCH_ORDER = {"x": 3}', "TORCH_ORDER = {'x': 3}: expected a dict"),
    ('TORCH_ORDER = {"z": "bln"}', "torch order: no tensor 'z'; the data inputs and outputs are x, out0"),
    ('WEIGHTS = {"hf": {"w": 3}}', "WEIGHTS = {'hf': {'w': 3}}: expected a dict of PyTorch module kinds to dicts"),
    ('HF_CONFIG = {"eps": object()}', "HF_CONFIG: Object of type object is not JSON serializable"),
    ('HF_CONFIG = {"sliding_window": [None, {"min": 8}]}',  # it was compared as a value: every model refused
     "HF_CONFIG has the value {'min': 8}; a dict there is a lower bound, {'at least': number}"),
])
def test_a_torch_table_of_the_wrong_type_is_one_line(tmp_path, capsys, line, says):
    """TORCH_ORDER, WEIGHTS or HF_CONFIG of the wrong type ended the job in a traceback
    (AttributeError, TypeError) after the analysis; now one line naming the table, nothing written."""
    path = tmp_path / "spec.py"
    path.write_text(textwrap.dedent(GOOD_HEADER) + f"{line}\n" + textwrap.dedent('''
        def layer(x: Tensor("bln"), w: Tensor("mn")):
            return np.einsum("bln,mn->blm", x, w)
        '''))
    assert main([str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and says in err, err
    assert not (tmp_path / "out").exists()


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
    assert "contradictory dims" in err and "letter b" in err and ":8: " in err


def test_unknown_dim_on_command_line(tmp_path, capsys):
    _, err = _run(tmp_path, capsys, SCALE_LAYER, "--dims", "Q=2")
    assert "unknown dims Q" in err


def test_file_without_layer_function(tmp_path, capsys):
    _, err = _run(tmp_path, capsys, '''
        def helper(x):
            return x
        ''')
    assert "no layer function" in err and "Tensor(" in err


@pytest.mark.parametrize("content, byte", [(b"\xff\xfe\x00i\x00m\x00", 0), (b"import numpy\x00\x01\x02", 12),
                                           ("x = 'caf\u00e9'\n".encode("latin-1"), 8)])
def test_spec_that_is_not_utf8_text_is_named(tmp_path, capsys, content, byte):
    path = tmp_path / "spec.py"
    path.write_bytes(content)
    with pytest.raises(SpecError, match=rf"^{re.escape(str(path))}: not a UTF-8 Python source file \(byte {byte}\)"):
        load_spec(path)
    assert main([str(path), "--analyze"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and f"{path}: not a UTF-8" in err, err


def test_spec_path_that_is_a_folder_or_missing_is_named(tmp_path, capsys):
    assert main([str(tmp_path), "--analyze"]) == 2
    assert f"{tmp_path}: a folder, not a spec file" in capsys.readouterr().err
    assert main([str(tmp_path / "nowhere.py"), "--analyze"]) == 2
    assert f"{tmp_path / 'nowhere.py'}: no such spec file" in capsys.readouterr().err


@pytest.mark.parametrize("line, says", [
    ("raise SystemExit(3)", "{path}:2: error while loading the spec: SystemExit: 3"),  # exit 3, nothing said
    ('OPTIONS = {"activation": ()}', "{path}: OPTIONS['activation'] is (); expected a tuple of its values"),  # IndexError
])
def test_a_spec_exiting_or_offering_an_option_without_values_is_named(tmp_path, capsys, line, says):
    path = tmp_path / "spec.py"
    bert = Path("configs/bert.py").read_text()
    path.write_text(f"import numpy as np\n{line}\n" if "SystemExit" in line
                    else bert.replace('OPTIONS = {"activation": ("relu", "gelu")}', line, 1))
    assert main([str(path), "--analyze"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert says.format(path=path) in err, err

def test_an_option_whose_constant_the_spec_does_not_define_is_named(tmp_path, capsys):
    """OPTIONS = {"act": ...} sets ACT; a spec branching on a constant spelt act kept act's value
    whatever --set said (--set act=tanh gave a ReLU layer, silently): refused with OPTIONS' line."""
    path, err = _run(tmp_path, capsys, '''
        OPTIONS = {"act": ("relu", "tanh")}
        act = "relu"


        def layer(x: Tensor("bln")):
            h = np.maximum(x, 0.0)
            if act == "tanh":
                h = np.tanh(x)
            return h
        ''', "--set", "act=tanh")
    assert f"{path}:7: OPTIONS offers 'act', which sets the module constant ACT, and the spec defines no ACT: " \
        "define ACT = 'relu' (the default) and branch on it" in err, err


@pytest.mark.parametrize("name", ["\u00e9coute.py", "my-layer.py", "2 layers.py"])
def test_a_spec_file_name_dace_would_refuse_as_an_sdfg_name_runs(tmp_path, capsys, name):
    """The spec's module name, which DaCe's SDFG names carry, is made of the file's stem with every
    character but ASCII letters, digits and underscores replaced (``écoute.py`` and ``my-layer.py``
    failed inside DaCe: invalid SDFG name)."""
    path = tmp_path / name
    path.write_text(GOOD_HEADER + textwrap.dedent('''
        def layer(x: Tensor("bln"), w: Tensor("mn")):
            return np.einsum("bln,mn->blm", x, w)
        '''), encoding="utf-8")
    assert main([str(path), "--analyze"]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("body, line, name", [
    ('''
     def couche(x: Tensor("bln"), w: Tensor("mn")):
         r\u00e9sidu = np.einsum("bln,mn->blm", x, w)
         return r\u00e9sidu
     ''', 8, "r\u00e9sidu"),
    ('''
     def couche(x: Tensor("bln"), w\u00e9: Tensor("mn")):
         return np.einsum("bln,mn->blm", x, w\u00e9)
     ''', 7, "w\u00e9"),
    ('''
     def \u00e9coute(x: Tensor("bln"), w: Tensor("mn")):
         return np.einsum("bln,mn->blm", x, w)
     ''', 7, "\u00e9coute"),
], ids=["variable", "argument", "function"])
def test_a_name_that_is_not_ascii_is_named_with_its_line(tmp_path, capsys, body, line, name):
    """DaCe reads ASCII names only (it failed with 'Invalid symbol name' or 'Invalid SDFG name')."""
    path, err = _run(tmp_path, capsys, body)
    assert f"{path}:{line}: the name {name!r} is not ASCII" in err, err


TWO_LAYERS = '''
def scale(x):
    return x * np.float32(2)


def first(x: Tensor("bln"), w: Tensor("mn")):
    return np.einsum("bln,mn->blm", scale(x), w)


def second(x: Tensor("bln"), w: Tensor("mn")):
    return np.einsum("bln,mn->blm", x, w) + np.float32(1)
'''
DEFINED = "its layer functions (arguments all annotated Tensor or Dropout): first, second; its other functions: scale"


@pytest.mark.parametrize("layer, says", [
    ('"nope"', "{path}:6: LAYER = 'nope': spec.py defines no function nope; " + DEFINED),  # ignored: first, or several
    ('"scale"', "{path}:6: LAYER = 'scale': not a layer function: its arguments are not all annotated"),
    ("3", '{path}:6: LAYER = 3: expected the name of the layer function, e.g. LAYER = "first"; ' + DEFINED),
    (None, 'several layer functions (first, second): set LAYER = "<the name of one of them>", e.g. LAYER = "first"'),
])
def test_a_layer_choice_naming_no_layer_function_is_named_with_the_functions(tmp_path, capsys, layer, says):
    """``LAYER`` names the layer function of a spec defining several (docs/specs.md); one naming no
    layer function was ignored (the spec's one layer function ran, or 'several layer functions')."""
    path, err = _run(tmp_path, capsys, (f"LAYER = {layer}\n" if layer else "") + TWO_LAYERS)
    assert says.format(path=path) in err, err


@pytest.mark.parametrize("layer", ['"second"', "second"])
def test_layer_names_the_layer_function_by_name_or_as_itself(tmp_path, layer):
    path = tmp_path / "spec.py"
    path.write_text(textwrap.dedent(GOOD_HEADER) + TWO_LAYERS + f"\nLAYER = {layer}\n")
    assert load_spec(path).name == "second"
