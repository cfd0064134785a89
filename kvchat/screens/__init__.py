"""Modal screens: help, the policy picker, the model's figures, the chat browser."""
from .help_screen import HelpScreen
from .policy_picker import PolicyPicker

__all__ = ["HelpScreen", "PolicyPicker"]
