from vllm_ctxmgr.cli.main import main

main(prog_name="ctxmgr")
