"""The `workbench` command: its parser pieces, the strategy settings as flags, `workbench train`."""
