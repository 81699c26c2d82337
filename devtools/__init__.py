"""Development helpers shared by the tests and the benchmarks: the model folders they run on, a real server
process, and a from-scratch reference decoder. Not part of the chatd package: the server never imports this, and
it needs the ``dev`` or ``bench`` extra (httpx, tomli-w)."""
