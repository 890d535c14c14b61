"""One model over several nodes: the coordinator orders the nodes and decides, each node's steps run as
`ctxmgr node STEP` there (node), over ssh (remote), in typed and versioned messages checked at the door
(wire)."""
