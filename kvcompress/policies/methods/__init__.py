"""One module per compression method, each defining its ``CompressionMethod`` record.

``base`` holds the record type and the ``SelectionBlock`` a method's selection receives; the list
of methods users can choose is ``kvcompress.policies.registry.COMPRESSION_METHODS``.
"""
