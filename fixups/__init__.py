"""The writers that fix a checkpoint for the engines: the exclude aliases (fixup), a re-injected MTP layer
(mtp_inject), a pull request with the fix (hub_pr). The checks they rely on are in validation/."""
