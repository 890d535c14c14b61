class BaseFrontendArgs:
    chat_template: str | None = None


class FrontendArgs(BaseFrontendArgs):
    host: str | None = None
    port: int = 8000
    grpc_port: int | None = None


def make_arg_parser(parser):
    parser.add_argument("model_tag", nargs="?")
    parser.add_argument("--headless", action="store_true")
    parser.add_argument("--grpc", action="store_true")
    return parser
