"""The benchmark scripts (run as files) and their shared module :mod:`benchmarks.tables`.

A package, not a namespace folder: opacus installs a top-level ``benchmarks`` package, and a regular
package earlier on ``sys.path`` is the only way this one is found first.
"""
