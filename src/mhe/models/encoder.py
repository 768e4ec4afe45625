"""Encoder-only transformer (BERT, paper section 4.3) and its task heads."""

from __future__ import annotations

from torch import nn

from mhe.attention import masks
from mhe.models.blocks import Block, Embeddings, activation, init_model
from mhe.models.config import ModelConfig
from mhe.models.inputs import check_labels, check_mask
from mhe.models.losses import chunked_loss_wanted, classification_loss, head_loss, span_loss, token_loss
from mhe.models.outputs import ModelOutput, as_bool_mask


class Encoder(nn.Module):
    """Post-LN BERT encoder: learned positions, token types, ``cfg.activation`` feed-forward."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = Embeddings(cfg, norm=not cfg.norm_first)
        self.layers = nn.ModuleList(Block(cfg, causal=False, cross=False) for _ in range(cfg.n_layers))
        self.final_norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps) if cfg.norm_first else None

    def forward(self, input_ids, attention_mask=None, token_type_ids=None):
        positions = self.embed.token_positions(input_ids)  # [T], for every layer
        x = self.embed(input_ids, positions=positions, token_types=token_type_ids)  # [B, T, m]
        check_mask("attention_mask", attention_mask, *input_ids.shape)
        mask = masks.padding_mask(as_bool_mask(attention_mask))  # once, for every layer
        for layer in self.layers:
            x = layer(x, positions=positions, mask=mask)
        return self.final_norm(x) if self.final_norm is not None else x


class _EncoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.encoder = Encoder(cfg)

    def reset_parameters(self) -> None:
        """(Re)draw every weight by BERT's scheme (:func:`mhe.models.blocks.init_model`); run when
        built, and by the Hugging Face adapter when it builds its own core."""
        init_model(self)


class EncoderForMaskedLM(_EncoderModel):
    """BERT masked-LM head: dense + activation + LayerNorm, decoder tied to the token embeddings."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.transform = nn.Sequential(nn.Linear(cfg.d_model, cfg.d_model), activation(cfg.activation),
                                       nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps))
        self.decoder = nn.Linear(cfg.d_model, cfg.vocab_size)
        self.reset_parameters()
        if cfg.tie_embeddings:
            self.decoder.weight = self.encoder.embed.tokens.weight
        self.vocab_modules = ("encoder.embed.tokens", "decoder")  # a row per token (mhe.models.vocab_padding)

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, labels=None, masked_positions=None,
                chunked_loss=None):
        """``masked_positions``: the flat indices (into ``[B*T]``) of the labelled positions, as
        the data collator lists them where reading them costs no device sync (extra entries
        may repeat any position whose label is -100, so that a batch has a fixed size); then the
        head runs only there, as in :meth:`masked_lm_loss`, and only the loss is returned
        (``chunked_loss``: :func:`~mhe.models.losses.chunked_loss_wanted`)."""
        h = self.encoder(input_ids, attention_mask, token_type_ids)
        check_labels("labels", labels, input_ids.shape)
        if masked_positions is not None:
            return self._masked_head(h, labels, masked_positions, return_logits=False, chunked_loss=chunked_loss)
        logits = self._logits(self.transform(h))  # [B, T, V]
        loss = None
        if labels is not None:
            loss = token_loss(logits, labels)
        return ModelOutput(logits, loss, h)

    def _logits(self, x):
        return self.decoder(x)[..., :self.cfg.vocab_size]  # padding rows never score

    def masked_lm_loss(self, input_ids, labels, attention_mask=None, token_type_ids=None) -> ModelOutput:
        """The loss of :meth:`forward`, with the head applied only where ``labels != -100``.

        BERT masks 15% of the tokens, so the dense + vocabulary projection on the other 85%
        is wasted work (a quarter of a 6-layer model's FLOPs at a 16k vocabulary). ``logits``
        are ``[N, V]`` for the N labelled positions, in row-major order of ``labels``."""
        h = self.encoder(input_ids, attention_mask, token_type_ids)
        return self._masked_head(h, labels, (labels.flatten() != -100).nonzero().squeeze(1))

    def _masked_head(self, h, labels, positions, *, return_logits=True, chunked_loss=None) -> ModelOutput:
        x = self.transform(h.flatten(0, 1)[positions])  # [N, m]
        target = labels.flatten()[positions]  # [N]
        if not return_logits and x.shape[0] and chunked_loss_wanted(x, self.decoder.weight, chunked_loss):
            return ModelOutput(None, head_loss(self.decoder, x, target, vocab_size=self.cfg.vocab_size), h)
        logits = self._logits(x)  # [N, V]
        if logits.shape[0] == 0:
            loss = logits.float().sum()  # nothing masked in this batch: a zero that keeps the graph
        else:
            loss = token_loss(logits, target)
        return ModelOutput(logits, loss, h)


class EncoderForSequenceClassification(_EncoderModel):
    """[CLS] pooler (dense + tanh) and a linear classifier; one label means regression."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.pooler = nn.Sequential(nn.Linear(cfg.d_model, cfg.d_model), nn.Tanh())
        self.drop = nn.Dropout(cfg.dropout)
        self.classifier = nn.Linear(cfg.d_model, cfg.num_labels)
        self.reset_parameters()

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, labels=None):
        h = self.encoder(input_ids, attention_mask, token_type_ids)
        logits = self.classifier(self.drop(self.pooler(h[:, 0])))  # [B, num_labels]
        loss = None if labels is None else classification_loss(logits, labels, self.cfg.num_labels)
        return ModelOutput(logits, loss, h)


class EncoderForQuestionAnswering(_EncoderModel):
    """Extractive QA: start and end logits per token (SQuAD)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.span = nn.Linear(cfg.d_model, 2)
        self.reset_parameters()

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, start_positions=None,
                end_positions=None):
        h = self.encoder(input_ids, attention_mask, token_type_ids)
        logits = self.span(h)  # [B, T, 2]
        loss = None
        if start_positions is not None and end_positions is not None:
            loss = span_loss(logits, start_positions, end_positions)
        return ModelOutput(logits, loss, h)
