"""bayesfl's ClientApp, except that client 1 uploads NaN in round 1 (a well-formed message
that the server's validation must reject; the digest is recomputed, so only the schema's
finiteness check can catch it)."""

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from bayesfl.flower import client_app as honest
from bayesfl.flower.protocol import pack, record_values
from bayesfl.messages import Message as BayesMessage
from bayesfl.messages import decode, encode

TAMPERER, ROUND = 1, 1

app = ClientApp()
app.query("info")(honest.info)
app.query("calibrate")(honest.calibrate)


@app.train("round")
def round_step(msg: Message, context: Context) -> Message:
    reply = honest.round_step(msg, context)
    values = record_values(reply.content)
    if "upload" not in values:
        return reply
    upload = decode(values["upload"])
    if upload.header.client_id == TAMPERER and upload.header.round == ROUND:
        tensors = dict(upload.tensors)
        name = sorted(k for k, v in tensors.items() if v.is_floating_point())[0]
        tensors[name] = tensors[name].clone().fill_(float("nan"))
        values["upload"] = encode(BayesMessage(upload.header, tensors))
    return Message(pack(**values), reply_to=msg)
