"""Per-head paged KV accounting (no vLLM imports): the page pool, the requests' page tables
and the prefix cache, composed by ``PageManager`` (one per rank in ``ShardedPageManager``)."""

from kvcompress.paging.layout import PageLayout
from kvcompress.paging.page_manager import PageManager
from kvcompress.paging.page_table import HeadPageTable
from kvcompress.paging.request_tables import PageTableDelta
from kvcompress.paging.sharded import ShardedPageManager

__all__ = ["HeadPageTable", "PageLayout", "PageManager", "PageTableDelta", "ShardedPageManager"]
