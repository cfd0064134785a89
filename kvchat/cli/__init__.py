"""The `kvchat` command: its arguments, the headless subcommands (ask, replay, info, bench) and the chat's launcher."""
