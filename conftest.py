# Root pytest config: what is not a test even though pytest could collect it.
collect_ignore_glob = ["_build/*", ".venv/*", "tests/fixtures/*"]
