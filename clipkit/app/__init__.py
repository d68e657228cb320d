"""The application: the thin CLI (cli), its typed functions (api), helpers for plugin commands
(commands), training on your own table (own_data, run_length), watching a run (watch), quiet
third-party warnings (quiet).
"""
