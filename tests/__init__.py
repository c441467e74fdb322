"""The test suite: unit tests of the pure logic, exact-distribution tests of
the sampler, and end-to-end tests through real gRPC servers on loopback with
tiny random-weight models (``tests/tiny.py``, ``tests/stack.py``); one test
runs the real default models. Test-only code lives here, not in the packages."""
