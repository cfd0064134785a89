"""The Textual App shell: start-up and the backend load, settings, themes, the keymap, the command palette."""
