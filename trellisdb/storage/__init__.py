"""Physical storage: the commit log, the writer lock and the Lance datasets.

Everything Lance-specific lives in this package.
"""
