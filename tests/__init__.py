"""chatd's test suite.

``CHATD_CPU_ISA`` (chatd.engine.kernels.cpu) runs it as a smaller CPU class would: its cap is passed on to torch's and
oneDNN's own variables here, before any test module imports torch."""

from chatd.engine.kernels.cpu import library_environment

library_environment()
