"""bayesfl's ClientApp, except that client 1 uploads NaN in round 1 (a well-formed message
that the server's validation must reject; the digest is recomputed, so only the schema's
finiteness check can catch it)."""

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from bayesfl.flower import client_app as honest
from bayesfl.flower.protocol import pack, unpack
from bayesfl.messages import Message as BayesMessage
from bayesfl.messages import decode, encode

TAMPERER, ROUND = 1, 1

app = ClientApp()
app.query("info")(honest.info)
app.evaluate("evaluate")(honest.evaluate)
app.train("personalize")(honest.personalize)


@app.train("fit")
def fit(msg: Message, context: Context) -> Message:
    reply = honest.fit(msg, context)
    data, values = unpack(reply.content)
    upload = decode(data)
    if upload.header.client_id == TAMPERER and upload.header.round == ROUND:
        tensors = dict(upload.tensors)
        name = sorted(k for k, v in tensors.items() if v.is_floating_point())[0]
        tensors[name] = tensors[name].clone().fill_(float("nan"))
        data = encode(BayesMessage(upload.header, tensors))
    return Message(pack(data, **values), reply_to=msg)
