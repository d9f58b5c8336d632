"""Per-head paged KV accounting: page tables and the page pool (no vLLM imports)."""

from kvcompress.paging.layout import PageLayout
from kvcompress.paging.page_manager import PageManager, PageTableDelta
from kvcompress.paging.page_table import HeadPageTable
from kvcompress.paging.sharded import ShardedPageManager

__all__ = ["HeadPageTable", "PageLayout", "PageManager", "PageTableDelta", "ShardedPageManager"]
