from typing import Optional


class FrontendArgs:
    host: Optional[str] = None
    port: int = 8000
    disable_frontend_multiprocessing: bool = False


def make_arg_parser(parser):
    parser.add_argument("model_tag", nargs="?")
    parser.add_argument("--headless", action="store_true")
    return parser
