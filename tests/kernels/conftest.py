"""Run the Triton kernels on the CPU through triton's interpreter.

TRITON_INTERPRET is read when triton is first imported, so it is set here, before any test
module (or engine.kernels.*) imports triton. (tests/conftest.py runs torch on one thread: the
interpreter runs every program step as small torch ops, where a second thread only stalls.)
"""

import os

os.environ["TRITON_INTERPRET"] = "1"
