"""The `tokenmux` command line (main.py), the serve/status/shutdown commands (commands.py)
and the demo job (demo.py)."""
