"""scripts/bench_matvec.py's argument checks: a bad type or shape is an argparse error (exit 2,
the known names listed), never a traceback; type names in either case, as llama.cpp's tools take them."""
from __future__ import annotations

import pytest

import bench_matvec  # scripts/ is on sys.path (conftest)


@pytest.mark.parametrize("argv, message, a_known_name", [
    (["--types", "q4_k,q4_x"], "--types: unknown Q4_X; known: ", "Q4_K"),
    (["--shapes", "huge"], "--shapes: unknown huge; known: ", "qwen3.6-27b up"),
])
def test_bad_arguments_exit_2(capsys, argv, message, a_known_name):
    with pytest.raises(SystemExit) as exc:
        bench_matvec.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert a_known_name in err.split("known: ", 1)[1]
