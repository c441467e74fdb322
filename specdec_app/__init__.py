"""The entry points, on top of the services: the ``specdec`` command line
(``serve`` hands over to each service's own ``cli`` module, ``up`` composes
them into child processes), the Python client library, the benchmarks, and
the TCP delay proxy. The only package that imports several services."""
