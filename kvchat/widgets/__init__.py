"""kvchat's widgets: one file each. They draw telemetry they are given; none calls the engine."""
from .block_map import BlockMap
from .cache_panel import CachePanel
from .cap_gauge import CapGauge
from .chat_input import ChatInput
from .conversation_bar import ConversationBar
from .latency_panel import LatencyPanel
from .panel_switcher import PanelSwitcher
from .status_bar import StatusBar
from .transcript import Notice, Reply, Transcript, UserMessage

__all__ = ["BlockMap", "CachePanel", "CapGauge", "ChatInput", "ConversationBar", "LatencyPanel",
           "PanelSwitcher", "StatusBar", "Notice", "Reply", "Transcript", "UserMessage"]
