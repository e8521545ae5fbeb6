"""Core: physical points, id rules and conventions as data, the spec, and the error kinds.

Imports neither torch nor libcst: loading and linting a spec needs no engine."""
