// Affinity for Nginx's njs module: the key `hash $affinity_key consistent` routes a request by, so each
// conversation reaches the instance that holds its KV cache — from what clients already send, no header
// of ours needed. Rendered beside nginx.conf by `python -m service.deploy` (service/deploy/nginx.py).
//
// The key, the first of: the X-Conversation-Id header; the id in the URL (/v1/responses/ID,
// /v1/conversations/ID); the body's native `conversation_id`, `previous_response_id`, `conversation`,
// `prompt_cache_key`, `user`, Anthropic's `metadata.user_id`; else a hash of the first messages (the
// system prompt and the first user turn), which a stateless client resends unchanged every turn. An id
// the service made begins with its conversation's key (ID_KEY): the service makes ids with the key this
// script sent it (X-Affinity-Key), so a follow-up naming the id lands where the conversation lives.
// No key (a GET of /v1/models, a batch upload): the empty string, which Nginx balances round-robin.
//
// Nginx keeps every body in a temporary file (client_body_in_file_only clean), read here. A body up to
// PARSED_BYTES is parsed as it is; a larger one (it carries pictures) is parsed with each string longer
// than LONG_STRING bytes stood in for by its length and ends (found with Buffer searches, in C), as the
// parse of a smaller body does too: a picture's base64 is seen alike either way, so a conversation keeps
// its key as its body grows past the bound; and the pictures' megabytes never become a JavaScript string,
// which would hold Nginx's one event loop far longer.

var crypto = require('crypto');
var fs = require('fs');

var ID_KEY = /^(?:conv-|conv_|resp_)([0-9a-f]{16})[0-9a-f]+$/;
var URL_ID = /^\/v1\/(?:responses|conversations)\/([A-Za-z0-9_.:-]+)/;
var PARSED_BYTES = 1048576;
var LONG_STRING = 4096;
var BACKSLASH = 92;

function hashed(text) {
    return crypto.createHash('sha1').update(text).digest('hex').slice(0, 16);
}

function ofId(id) {
    var found = ID_KEY.exec(id);
    return found ? found[1] : hashed('id:' + id);
}

function text(content) {
    // A message's content as one string, alike whichever form it was sent in (a string, or parts).
    if (typeof content === 'string') {
        return content;
    }
    if (!Array.isArray(content)) {
        return JSON.stringify(content === undefined ? null : content);
    }
    return content.map(function (part) {
        if (typeof part === 'string') {
            return part;
        }
        if (part && typeof part.text === 'string') {
            return part.text;
        }
        var url = part && (part.image_url || part.source);
        if (url) {
            return typeof url === 'string' ? url : (url.url || url.data || JSON.stringify(url));
        }
        return JSON.stringify(part);
    }).join('\u0000');
}

function firstTurn(body) {
    // The system prompt and the first user turn, whatever the API: Chat Completions and the native
    // endpoint (`messages`, or `prompt`), Responses (`instructions`, `input`), Anthropic (`system`).
    var system = body.system !== undefined ? text(body.system) : (body.instructions || '');
    var user = null;
    var messages = Array.isArray(body.messages) ? body.messages : Array.isArray(body.input) ? body.input : [];
    if (typeof body.input === 'string') {
        user = body.input;
    } else if (typeof body.prompt === 'string') {
        user = body.prompt;
    }
    for (var i = 0; user === null && i < messages.length; i++) {
        var m = messages[i] || {};
        if (m.role === 'system' || m.role === 'developer') {
            system += '\u0000' + text(m.content);
        } else if (m.role === 'user') {
            user = text(m.content);
        }
    }
    return user === null ? '' : hashed('first:' + system + '\u0001' + user);
}

function ofParsed(body) {
    if (typeof body.conversation_id === 'string') {
        return ofId(body.conversation_id);
    }
    if (typeof body.previous_response_id === 'string') {
        return ofId(body.previous_response_id);
    }
    var conversation = body.conversation;
    if (conversation && typeof conversation.id === 'string') {
        conversation = conversation.id;
    }
    if (typeof conversation === 'string') {
        return ofId(conversation);
    }
    if (typeof body.prompt_cache_key === 'string') {
        return hashed('cache:' + body.prompt_cache_key);
    }
    if (typeof body.user === 'string') {
        return hashed('user:' + body.user);
    }
    if (body.metadata && typeof body.metadata.user_id === 'string') {
        return hashed('user:' + body.metadata.user_id);
    }
    return firstTurn(body);
}

function standIn(length, head, tail) {
    return '\u0002' + length + ':' + head + tail;
}

function parsed(text) {
    return JSON.parse(text, function (name, value) {
        if (typeof value === 'string' && value.length > LONG_STRING) {
            return standIn(value.length, value.slice(0, 32), value.slice(-32));
        }
        return value;
    });
}

function shortened(data) {
    // The JSON text of a large body with its long strings stood in for (their ends as bytes: pictures'
    // base64 is ASCII, where bytes and characters agree).
    var pieces = [];
    var copied = 0;
    var at = data.indexOf('"');
    while (at >= 0) {
        var end = data.indexOf('"', at + 1);
        while (end > 0) {
            var slashes = 0;
            while (data[end - 1 - slashes] === BACKSLASH) {
                slashes++;
            }
            if (slashes % 2 === 0) {
                break;
            }
            end = data.indexOf('"', end + 1);
        }
        if (end < 0) {
            return null;
        }
        var length = end - at - 1;
        if (length > LONG_STRING) {
            var ends = data.slice(at + 1, at + 33).toString() + data.slice(end - 32, end).toString();
            pieces.push(data.slice(copied, at + 1).toString(), JSON.stringify(standIn(length, ends, '')).slice(1, -1));
            copied = end;
        }
        at = data.indexOf('"', end + 1);
    }
    pieces.push(data.slice(copied).toString());
    return pieces.join('');
}

function formField(data, name) {
    var at = data.indexOf('; name="' + name + '"');
    if (at < 0) {
        return null;
    }
    var start = data.indexOf('\r\n\r\n', at);
    var end = start < 0 ? -1 : data.indexOf('\r\n--', start + 4);
    return end < 0 ? null : data.slice(start + 4, end).toString();
}

function ofForm(data) {
    // The native endpoint's multipart form (curl -F): its conversation_id, else its prompt.
    var id = formField(data, 'conversation_id');
    if (id) {
        return ofId(id);
    }
    var prompt = formField(data, 'prompt');
    return prompt === null ? '' : hashed('first:\u0001' + prompt);
}

function body(r) {
    // Nginx keeps every body in a temporary file (client_body_in_file_only clean): read it there.
    var file = r.variables.request_body_file;
    return file ? fs.readFileSync(file) : null;
}

function key(r) {
    var header = r.headersIn['X-Conversation-Id'];
    if (header) {
        return ofId(header);
    }
    var inUrl = URL_ID.exec(r.uri);
    if (inUrl) {
        return ofId(inUrl[1]);
    }
    if (r.method !== 'POST') {
        return '';
    }
    var data;
    try {
        data = body(r);
    } catch (e) {
        return '';
    }
    if (!data || data.length === 0) {
        return '';
    }
    var type = r.headersIn['Content-Type'] || '';
    if (type.indexOf('multipart/form-data') === 0) {
        return ofForm(data);
    }
    try {
        var found = parsed(data.length > PARSED_BYTES ? shortened(data) : data.toString());
        return found && typeof found === 'object' ? ofParsed(found) : '';
    } catch (e) {
        return '';
    }
}

export default {key};
